"""Sandbox runtimes: one module each (``local``, ``bwrap``, ``oci``), all behind :class:`base.Runtime`."""
