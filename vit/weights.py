"""Weights from local files: timm, Hugging Face and torchvision ViT checkpoints in safetensors.

``load_pretrained(model, checkpoint_path)`` goes through six steps, each a function below:

1. read     a ``.safetensors`` file only: a pickled checkpoint (``.bin``, ``.pth``) can run code when loaded
2. detect   the source library from the keys
3. rename   the keys to ours (timm's names); separate q, k, v projections are packed into one ``qkv``,
            a gated MLP's packed ``fc1`` is split into its gate and up projections
4. check    the architecture the weights imply (depth, width, patch, MLP, tokens) against ``model.config``
5. adapt    resample the position embedding to the model's patch grid (as timm does), and keep the
            model's own head when the checkpoint's is for another number of classes
6. load     strictly, after naming every missing, unexpected or mis-shaped key

The weights do not record ``num_heads``, the activation or LayerNorm's eps, so the preset (or the
overrides) must match them: Hugging Face's ViT uses ``norm_eps=1e-12``, timm and torchvision 1e-6.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file

if TYPE_CHECKING:
    from vit.model import ViT

FORMATS = ("timm", "huggingface", "torchvision")
PICKLE_SUFFIXES = (".bin", ".pth", ".pt", ".ckpt", ".pkl", ".pickle")
_SHOWN = 10  # keys listed per kind of problem in an error
_FIELD = {"mlp_hidden_features": "mlp_hidden_dim"}  # implied_config's name -> the ViTConfig field to set

# (source pattern, our name); patterns are anchored, `(?P<i>...)` is the block index and
# `(?P<p>weight|bias)` the parameter, both carried into the target.
_P = r"\.(?P<p>weight|bias)$"
_HF_LAYER = r"^(?:vit\.)?(?:encoder\.layer|layers)\.(?P<i>\d+)\."  # transformers 4.x files | 5.x modules
_HUGGINGFACE_RULES = (
    (r"^(?:vit\.)?embeddings\.cls_token$", "cls_token"),
    (r"^(?:vit\.)?embeddings\.position_embeddings$", "pos_embed"),
    (r"^(?:vit\.)?embeddings\.patch_embeddings\.projection" + _P, r"patch_embed.proj.\g<p>"),
    (_HF_LAYER + r"layernorm_before" + _P, r"blocks.\g<i>.norm1.\g<p>"),
    (_HF_LAYER + r"attention\.(?:attention\.query|q_proj)" + _P, r"blocks.\g<i>.attn.q.\g<p>"),
    (_HF_LAYER + r"attention\.(?:attention\.key|k_proj)" + _P, r"blocks.\g<i>.attn.k.\g<p>"),
    (_HF_LAYER + r"attention\.(?:attention\.value|v_proj)" + _P, r"blocks.\g<i>.attn.v.\g<p>"),
    (_HF_LAYER + r"attention\.(?:output\.dense|o_proj)" + _P, r"blocks.\g<i>.attn.proj.\g<p>"),
    (_HF_LAYER + r"layernorm_after" + _P, r"blocks.\g<i>.norm2.\g<p>"),
    (_HF_LAYER + r"(?:intermediate\.dense|mlp\.fc1)" + _P, r"blocks.\g<i>.mlp.fc1.\g<p>"),
    (_HF_LAYER + r"(?:output\.dense|mlp\.fc2)" + _P, r"blocks.\g<i>.mlp.fc2.\g<p>"),
    (r"^(?:vit\.)?layernorm" + _P, r"norm.\g<p>"),
    (r"^classifier" + _P, r"head.\g<p>"),
)
# ViTModel's pooler and the masked-image-modelling token take no part in classification.
_HUGGINGFACE_UNUSED = r"^(?:vit\.)?(?:pooler\.dense" + _P + r"|embeddings\.mask_token$)"

_TV_LAYER = r"^encoder\.layers\.encoder_layer_(?P<i>\d+)\."
_TORCHVISION_RULES = (
    (r"^class_token$", "cls_token"),
    (r"^encoder\.pos_embedding$", "pos_embed"),
    (r"^conv_proj" + _P, r"patch_embed.proj.\g<p>"),
    (_TV_LAYER + r"ln_1" + _P, r"blocks.\g<i>.norm1.\g<p>"),
    (_TV_LAYER + r"self_attention\.in_proj_(?P<p>weight|bias)$", r"blocks.\g<i>.attn.qkv.\g<p>"),
    (_TV_LAYER + r"self_attention\.out_proj" + _P, r"blocks.\g<i>.attn.proj.\g<p>"),
    (_TV_LAYER + r"ln_2" + _P, r"blocks.\g<i>.norm2.\g<p>"),
    (_TV_LAYER + r"mlp\.(?:0|linear_1)" + _P, r"blocks.\g<i>.mlp.fc1.\g<p>"),  # linear_1: before 0.13
    (_TV_LAYER + r"mlp\.(?:3|linear_2)" + _P, r"blocks.\g<i>.mlp.fc2.\g<p>"),
    (r"^encoder\.ln" + _P, r"norm.\g<p>"),
    (r"^heads\.head" + _P, r"head.\g<p>"),
)
# EVA02 (timm's Eva): a fused qkv weight with separate q and v biases (k has none), or separate
# q, k, v projections (EVA02-B/L); both are packed into qkv, k's bias zero.
_TIMM_RULES = (
    (r"^blocks\.(?P<i>\d+)\.attn\.(?P<n>q|k|v)_proj" + _P, r"blocks.\g<i>.attn.\g<n>.\g<p>"),
    (r"^blocks\.(?P<i>\d+)\.attn\.(?P<n>q|v)_bias$", r"blocks.\g<i>.attn.\g<n>.bias"),
)
_RULES = {"timm": _TIMM_RULES, "huggingface": _HUGGINGFACE_RULES, "torchvision": _TORCHVISION_RULES}
_UNUSED = {"huggingface": _HUGGINGFACE_UNUSED}


@dataclass(frozen=True)
class LoadReport:
    """What ``load_pretrained`` did."""

    source: str  # one of FORMATS
    pos_embed_resampled: Optional[tuple[tuple[int, int], tuple[int, int]]]  # (checkpoint grid, model grid)
    head_loaded: (
        bool  # False: the checkpoint's head was for another num_classes (or absent); the model's kept
    )
    unused: tuple[str, ...]  # checkpoint keys a classifier does not use (Hugging Face's pooler, mask token)


def load_pretrained(model: "ViT", checkpoint_path: Union[str, Path]) -> LoadReport:
    """Load a timm, Hugging Face (``ViTModel`` / ``ViTForImageClassification``) or torchvision
    (``VisionTransformer``) ViT checkpoint from a ``.safetensors`` file into ``model``, in place.

    The position embedding (1, prefix + h*w, D) is resampled to the model's patch grid when they
    differ; a head (num_classes, D) for another ``num_classes`` is not loaded (the model keeps its own,
    freshly initialised by ``create_model``). Anything else that does not fit raises ValueError naming
    the config fields or the keys, before any weight is copied.
    """
    tensors = read_safetensors(checkpoint_path)
    source = detect_format(tensors, checkpoint_path)
    state, origin, unused = rename_keys(tensors, source)
    where = f"checkpoint_path {str(checkpoint_path)!r} ({source})"
    check_architecture(state, model, where)
    grids = adapt_pos_embed(state, model, where)
    head_loaded = adapt_head(state, model)
    check_keys(state, model, origin, where)
    model.load_state_dict(state, strict=True)
    return LoadReport(source, grids, head_loaded, tuple(unused))


def read_safetensors(checkpoint_path: Union[str, Path]) -> dict[str, torch.Tensor]:
    """The tensors of a ``.safetensors`` file, on the CPU. Pickled checkpoints are refused: unpickling
    can run arbitrary code."""
    path = Path(checkpoint_path)
    convert = (
        "convert it to safetensors (if you trust its source): state_dict = torch.load(path, weights_only=True); "
        "safetensors.torch.save_file(state_dict, 'model.safetensors')"
    )
    if path.suffix.lower() in PICKLE_SUFFIXES:
        raise ValueError(
            f"checkpoint_path {str(path)!r} is a pickled checkpoint ({path.suffix}), which is not loaded: {convert}"
        )
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint_path {str(path)!r} is not a file")
    try:
        return load_file(path)
    except (SafetensorError, ValueError, OSError) as error:
        if _looks_pickled(path):
            raise ValueError(
                f"checkpoint_path {str(path)!r} is a pickled (torch.save) checkpoint, which is not loaded: {convert}"
            ) from error
        raise ValueError(
            f"checkpoint_path {str(path)!r} is not a readable safetensors file: {error}"
        ) from error


def _looks_pickled(path: Path) -> bool:
    """torch.save writes a zip archive (``PK``) or, in its legacy format, a pickle (protocol 2+: 0x80)."""
    with open(path, "rb") as file:
        head = file.read(2)
    return head == b"PK" or (len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5)


def detect_format(tensors: dict[str, torch.Tensor], checkpoint_path: Union[str, Path] = "") -> str:
    """The library that wrote ``tensors`` (one of FORMATS), from the patch-embedding key each one uses."""
    if "patch_embed.proj.weight" in tensors:
        return "timm"
    if any(re.match(r"^(?:vit\.)?embeddings\.patch_embeddings\.projection\.weight$", key) for key in tensors):
        return "huggingface"
    if "conv_proj.weight" in tensors and "encoder.pos_embedding" in tensors:
        return "torchvision"
    raise ValueError(
        f"checkpoint_path {str(checkpoint_path)!r}: cannot tell its format from its keys (expected timm's "
        "'patch_embed.proj.weight', Hugging Face's 'vit.embeddings.patch_embeddings.projection.weight' or "
        f"torchvision's 'conv_proj.weight' with 'encoder.pos_embedding'); its keys start {_listed(sorted(tensors))}"
    )


def rename_keys(
    tensors: dict[str, torch.Tensor], source: str
) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
    """Checkpoint ``tensors`` in ``source``'s names -> (state dict in our names, our name -> the
    checkpoint's name(s), the keys a classifier does not use). Keys no rule knows keep their names
    (and are reported as unexpected later)."""
    state, origin, unused = {}, {}, []
    for key, value in tensors.items():
        if source in _UNUSED and re.match(_UNUSED[source], key):
            unused.append(key)
            continue
        ours = _rename(key, _RULES[source])
        state[ours], origin[ours] = value, key
    _pack_qkv(state, origin)
    _split_glu(state, origin)
    return state, origin, unused


def _rename(key: str, rules: tuple[tuple[str, str], ...]) -> str:
    for pattern, target in rules:
        renamed, count = re.subn(pattern, target, key)
        if count:
            return renamed
    return key


def _pack_qkv(state: dict[str, torch.Tensor], origin: dict[str, str]) -> None:
    """Separate ``blocks.N.attn.{q,k,v}.{weight,bias}`` -> ``blocks.N.attn.qkv.*``, concatenated along
    the output dim: q (D, D), k (D, D), v (D, D) -> (3D, D), the layout of one Linear(D, 3D). A k bias
    that is absent beside q's and v's (EVA02's) is zero."""
    for key in [k for k in state if re.match(r"^blocks\.\d+\.attn\.q\.(weight|bias)$", k)]:
        parts = [key.replace(".attn.q.", f".attn.{name}.") for name in "qkv"]
        if key.endswith(".bias") and parts[1] not in state and parts[2] in state:
            state[parts[1]], origin[parts[1]] = torch.zeros_like(state[key]), "(zero k bias)"
        if all(part in state for part in parts):
            packed = key.replace(".attn.q.", ".attn.qkv.")
            state[packed] = torch.cat([state.pop(part) for part in parts], dim=0)
            origin[packed] = " + ".join(origin.pop(part) for part in parts)


def _split_glu(state: dict[str, torch.Tensor], origin: dict[str, str]) -> None:
    """A gated MLP packed in one ``fc1`` (timm's ``GluMlp``, EVA02-Ti/S: fc1 (2H, D) beside fc2 (D, H),
    the gate first) -> ``fc1_g`` and ``fc1_x``, the names of timm's ``SwiGLU`` and ours. A plain MLP's
    fc1 has as many rows as fc2 has columns, so the two cannot be confused."""
    for key in [k for k in state if re.match(r"^blocks\.\d+\.mlp\.fc1\.weight$", k)]:
        fc2 = state.get(key.replace(".fc1.", ".fc2."))
        if fc2 is None or fc2.dim() != 2 or state[key].shape[0] != 2 * fc2.shape[1]:
            continue
        for param in ("weight", "bias"):
            packed = key.replace(".weight", f".{param}")
            if packed in state:
                gate, up = state.pop(packed).chunk(2, dim=0)
                name = origin.pop(packed)
                for part, value in (("fc1_g", gate), ("fc1_x", up)):
                    ours = packed.replace(".fc1.", f".{part}.")
                    state[ours], origin[ours] = (
                        value,
                        f"{name} ({'first' if part == 'fc1_g' else 'second'} half)",
                    )


def implied_config(state: dict[str, torch.Tensor]) -> dict[str, object]:
    """The ViTConfig fields the weights (in our names) determine: depth, embed_dim, in_chans,
    patch_size, mlp_hidden_features, mlp_type, mlp_norm, fc_norm, class_token, qkv_bias, final_norm,
    and global_pool when it is attention pooling ("map"). Not rope: its tables are not saved."""
    implied: dict[str, object] = {}
    blocks = {int(m.group(1)) for key in state if (m := re.match(r"^blocks\.(\d+)\.", key))}
    implied["depth"] = max(blocks) + 1 if blocks else 0
    proj = state.get("patch_embed.proj.weight")  # (D, C, P, P), nn.Conv2d's layout
    if proj is not None and proj.dim() == 4:
        implied["embed_dim"], implied["in_chans"] = proj.shape[0], proj.shape[1]
        implied["patch_size"] = proj.shape[2] if proj.shape[2] == proj.shape[3] else tuple(proj.shape[2:])
    fc1 = state.get("blocks.0.mlp.fc1.weight", state.get("blocks.0.mlp.fc1_g.weight"))  # (hidden, D)
    if fc1 is not None:
        implied["mlp_hidden_features"] = fc1.shape[0]
    implied["mlp_type"] = "swiglu" if "blocks.0.mlp.fc1_g.weight" in state else "mlp"
    implied["mlp_norm"] = "blocks.0.mlp.norm.weight" in state
    implied["fc_norm"] = "fc_norm.weight" in state
    implied["class_token"] = "cls_token" in state
    implied["qkv_bias"] = "blocks.0.attn.qkv.bias" in state
    implied["final_norm"] = "norm.weight" in state
    if "attn_pool.latent" in state:  # the other poolings have no weights to tell them apart
        implied["global_pool"] = "map"
    return implied


def check_architecture(state: dict[str, torch.Tensor], model: "ViT", where: str) -> None:
    """Raise ValueError naming every config field on which the weights and ``model.config`` differ."""
    config = model.config
    mismatches = {  # named by the ViTConfig field a user sets
        _FIELD.get(name, name): (value, getattr(config, name))
        for name, value in implied_config(state).items()
        if getattr(config, name) != value
    }
    if not mismatches:
        return
    found = "; ".join(
        f"{name}: checkpoint {theirs!r}, model {ours!r}" for name, (theirs, ours) in mismatches.items()
    )
    hint = ", ".join(f"{name}={theirs!r}" for name, (theirs, _) in mismatches.items())
    note = ""
    if "patch_size" in mismatches:
        note = " (with an img_size it divides; resampling the patch kernel to another size is not supported)"
    raise ValueError(
        f"{where} holds another architecture than the model ({found}). "
        f"Create the model to match, e.g. create_model(name, checkpoint_path=..., {hint}){note}"
    )


def adapt_pos_embed(
    state: dict[str, torch.Tensor], model: "ViT", where: str
) -> Optional[tuple[tuple[int, int], tuple[int, int]]]:
    """Resample ``state["pos_embed"]`` to the model's patch grid when the checkpoint's differs;
    return (checkpoint grid, model grid) then, else None. A model with the fixed sin-cos table takes
    only that very table."""
    pos_embed = state.get("pos_embed")
    if pos_embed is None:
        return None
    if model.config.pos_embed != "learned":
        fixed = model.pos_embed
        if pos_embed.shape != fixed.shape or not torch.allclose(
            pos_embed.to(fixed), fixed, rtol=1e-5, atol=1e-6
        ):
            raise ValueError(
                f"{where} has a learned position embedding, but the model has the fixed sin-cos table "
                "(pos_embed='sincos'): create it with pos_embed='learned'"
            )
        return None
    prefix = int(model.config.class_token)
    if pos_embed.dim() != 3 or pos_embed.shape[0] != 1:
        raise ValueError(f"{where}: pos_embed must be (1, tokens, dim), got {tuple(pos_embed.shape)}")
    old_grid = _square_grid(pos_embed.shape[1], prefix, where)
    new_grid = tuple(model.patch_embed.grid_size)
    if old_grid == new_grid:
        return None
    state["pos_embed"] = resample_pos_embed(pos_embed, new_grid, old_grid, num_prefix_tokens=prefix)
    return old_grid, new_grid


def _square_grid(tokens: int, prefix: int, where: str) -> tuple[int, int]:
    """The (h, w) grid of a checkpoint's position embedding: its patch positions must be a square."""
    patches = tokens - prefix
    side = math.isqrt(max(patches, 0))
    if patches <= 0 or side * side != patches:
        raise ValueError(
            f"{where}: pos_embed's {tokens} tokens leave {patches} patch positions after {prefix} class token(s): "
            "not a square grid"
        )
    return side, side


def resample_pos_embed(
    pos_embed: torch.Tensor,
    new_grid: tuple[int, int],
    old_grid: tuple[int, int],
    num_prefix_tokens: int = 1,
) -> torch.Tensor:
    """(1, prefix + h*w, D) -> (1, prefix + H*W, D): the patch positions, as an (h, w) image with D
    channels, are resized to (H, W) by bicubic interpolation (align_corners=False, antialiased when
    shrinking), computed in float32 and returned in the input dtype; the prefix (class) tokens are
    kept as they are. The same numbers as timm's ``resample_abs_pos_embed``."""
    prefix, patches = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    dim = patches.shape[-1]
    image = patches.float().reshape(1, old_grid[0], old_grid[1], dim).permute(0, 3, 1, 2)
    image = F.interpolate(image, size=tuple(new_grid), mode="bicubic", align_corners=False, antialias=True)
    patches = image.permute(0, 2, 3, 1).reshape(1, new_grid[0] * new_grid[1], dim).to(pos_embed.dtype)
    return torch.cat([prefix, patches], dim=1)


def adapt_head(state: dict[str, torch.Tensor], model: "ViT") -> bool:
    """Whether the checkpoint's head (num_classes, D) fits the model's. When it does not (another
    num_classes, or no head on either side), the model's own head goes into ``state`` instead."""
    theirs = state["head.weight"].shape[0] if "head.weight" in state else 0
    if theirs == model.config.num_classes:
        return theirs > 0
    for key in ("head.weight", "head.bias"):
        state.pop(key, None)
    state.update({key: value for key, value in model.state_dict().items() if key.startswith("head.")})
    return False


def check_keys(state: dict[str, torch.Tensor], model: "ViT", origin: dict[str, str], where: str) -> None:
    """Raise ValueError listing the model's keys the checkpoint lacks, the checkpoint's keys the model
    lacks (in the checkpoint's names) and the shapes that differ."""
    expected = model.state_dict()
    missing = [key for key in expected if key not in state]
    unexpected = [origin.get(key, key) for key in state if key not in expected]
    shapes = [
        f"{origin.get(key, key)}: {tuple(value.shape)} (model's {key}: {tuple(expected[key].shape)})"
        for key, value in state.items()
        if key in expected and value.shape != expected[key].shape
    ]
    problems = [
        f"{title} ({len(items)}): {_listed(items)}"
        for title, items in (("missing", missing), ("unexpected", unexpected), ("shape mismatch", shapes))
        if items
    ]
    if problems:
        raise ValueError(f"{where} does not fit the model; " + "; ".join(problems))


def _listed(items: list[str]) -> str:
    shown = ", ".join(items[:_SHOWN])
    return shown + (f", ... and {len(items) - _SHOWN} more" if len(items) > _SHOWN else "")
