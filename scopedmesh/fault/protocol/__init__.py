"""The fault protocol's decisions as pure state machines: events in, actions out.

Nothing here owns a socket, a thread, a clock or a store: each machine is
handed what happened (a store's answer, a socket's TCP state, the time) and
says what to do next, as h11 is to HTTP. The liveness watch, the step, the
links and ``Replicas`` drive them with real I/O; the simulation in the tests
drives the very same objects with a simulated store, links and clock, and
explores their interleavings with hypothesis.

One module per decision: :mod:`~scopedmesh.fault.protocol.agreement` (the
survivors' agreement on lost ranks and committed steps),
:mod:`~scopedmesh.fault.protocol.verdict` (a step's vote and the doubt rule),
:mod:`~scopedmesh.fault.protocol.link` (whether a held link's peer is
reachable) and :mod:`~scopedmesh.fault.protocol.membership` (a replicated job's
epochs, admission and departure).
"""
