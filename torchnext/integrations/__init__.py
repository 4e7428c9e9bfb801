"""torchnext inside other trainers. Each integration is an optional extra and imports its trainer; nothing else in
torchnext imports this package (it is the top layer of the import contracts).

* :mod:`torchnext.integrations.torchtitan` (``pip install torchnext[titan]``): the low-precision model converter.
"""
