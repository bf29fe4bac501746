"""Which store client a formation uses, and what a formed group keeps alive.

The decision to clone torch's store client for a formation is an object the
caller holds (:class:`~scopedmesh.c10d.store.StoreUse`, one per group table),
and a liveness watch declares its thread there when it guards a mesh; nothing
is read from a thread's name. A formed group keeps its store, and with it the
formation's watch, for its whole life: that watch must not keep the liveness
watch (which holds the meshes that hold the group).
"""

from __future__ import annotations

import gc
import threading
import weakref
from datetime import timedelta
from typing import Any

import pytest

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


@pytest.mark.world(1)
def test_a_formation_under_a_watch_opens_no_store_connection(world: Any) -> None:
    """The watch's thread never uses the default store client, so a guarded mesh's group
    forms over that client, as in a single-threaded process: no new connection (torch's
    store server resolves each new peer in DNS on its one thread, 5 s when a lookup is
    lost). Another thread, whatever its name, still gets its formation a client of its own."""
    from scopedmesh import LivenessWatch, ProcessGroupMesh
    from scopedmesh.c10d import groups as _c10d

    default = _c10d.default_store()
    with LivenessWatch(interval=0.01, timeout=timedelta(seconds=5)) as watch:
        with watch.guard(ProcessGroupMesh(1, names=("x",))) as guarded:
            use = guarded._table.store_use
            assert use.sharing_threads() == 1
            assert use.formation_store(default) is default
            with ProcessGroupMesh(1, names=("x",)) as unguarded:  # the watch's thread counts
                assert unguarded._table.store_use.formation_store(default) is not default
            stop = threading.Event()
            other = threading.Thread(target=stop.wait, args=(5.0,), name=watch._thread.name)
            other.start()  # a user's thread, named like the watch's: it counts all the same
            try:
                assert use.sharing_threads() == 2
                assert use.formation_store(default) is not default  # a clone
            finally:
                stop.set()
                other.join()
            assert use.formation_store(default) is default


@pytest.mark.world(1)
def test_store_use_refuses_what_is_not_a_thread(world: Any) -> None:
    from scopedmesh.c10d.store import StoreUse

    with pytest.raises(TypeError, match=r"thread must be a threading\.Thread, got str"):
        StoreUse().declare_own_clients("scopedmesh-liveness-0")  # type: ignore[arg-type]


@pytest.mark.world(2)
def test_a_formed_group_does_not_keep_the_liveness_watch(world: Any) -> None:
    """group -> WatchedStore -> formation Watch -> LivenessWatch -> meshes -> group would be
    a cycle: the formation's watch lets the liveness watch go when formation ends.

    torch 2.13 drops its reference to the Python store after construction; a release that
    keeps it (as the group's backend keeps its store) is played here by keeping every
    WatchedStore made, so the edge the group would hold is the one checked.
    """
    from scopedmesh import LivenessWatch, ProcessGroupMesh
    from scopedmesh.c10d import diagnosis

    kept: list[Any] = []  # what a group's backend would keep: its store
    made = diagnosis.WatchedStore.__init__

    def keeping(self: Any, inner: Any, watch: Any) -> None:
        made(self, inner, watch)
        kept.append(self)

    diagnosis.WatchedStore.__init__ = keeping  # type: ignore[method-assign]
    try:
        watch = LivenessWatch(interval=0.01, timeout=timedelta(seconds=5))
        with watch, watch.guard(ProcessGroupMesh(2, names=("x",))) as mesh:
            mesh.get_group_along_axis("x")
            assert kept, "a gloo group forms over a WatchedStore"
            assert all(store.watch.done and store.watch.liveness is None for store in kept)
            assert not [r for r in gc.get_referrers(watch) if isinstance(r, diagnosis.Watch)]
    finally:
        diagnosis.WatchedStore.__init__ = made  # type: ignore[method-assign]
    held = weakref.ref(watch)
    gc.collect()
    gc.disable()  # from here only reference counting frees: nothing the stores hold keeps it
    try:
        del watch, mesh
        assert held() is None, [type(r).__name__ for r in gc.get_referrers(held())]
    finally:
        gc.enable()
    assert kept  # the stores, and their watches, are still alive
