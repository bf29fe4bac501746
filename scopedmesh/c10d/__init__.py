"""The torch boundary: the one layer that touches ``torch.distributed`` internals.

``groups`` builds, names, counts and destroys process groups; ``names`` names
their incarnations; ``store`` reaches torch's store and lays out every key
written there; ``diagnosis`` explains a group that does not form;
``closable`` is the gloo handle a mesh gives out; ``nccl`` aborts a mesh's
NCCL communicators, keeps a healed mesh's groups off WORLD's and checks torch's
NCCL watchdog settings;
``checks`` validates backends and timeouts; ``device_mesh`` builds a torch
``DeviceMesh`` over existing groups. Nothing here keeps state of its own.
"""
