"""Optional integrations with frameworks that take meshes: leaves nothing else imports.

Each module here needs an extra (``pip install "scopedmesh[torchtitan]"`` for
:mod:`scopedmesh.interop.torchtitan`) and is imported only by its users: the
core, ``import scopedmesh`` and the CLI never load one.
"""
