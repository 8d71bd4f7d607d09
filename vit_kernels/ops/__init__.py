"""One module per op: its kernels, launchers, autograd Function and the ``<op>_ref`` reference."""
