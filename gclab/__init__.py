"""gclab: the helper package of the course on Python garbage collection and GPU memory.

The learner's instruments, which lessons and hidden tests import (short modules a learner may read):
`memory` (the tensor-memory Meter), `gcwatch` (collections seen through gc.callbacks), `plots`
(timelines), `checks` (self-checks and hidden-test helpers: `flat_check`, `policy_check`, `observed`), `probes`
(a function swapped for one that notes its calls, a maker that notes the collector), `refs` (who holds an object), `held`
(which attribute of an object keeps the bytes), `graphs` (object graphs drawn offline), `cycles` (the
tensor-cycle detector: what a collection finds), `serving` (a model server, an open-loop load generator, and requests served in
this process with the collector's CPU time charged to each), `widgets` (controls that redraw a
figure, a live memory gauge, a picker that adds runs to a comparison), `traces` (recorded runs),
and what they stand on: `outside` (calls marked for an outside reader), `procfs` (a process as the
operating system reports it), `zygote` (a fork server that starts processes with gclab loaded),
`guard` (reasons a learner can read when graded code reaches for the tools or the machine), `pinning`
(gclab's names pinned in its bytecode), `environment` (the environment gclab started with).

Beside them, two subpackages that no instrument imports: `gclab.grader`, the grader an instructor
runs (`gclab release`, `gclab grade`), and `gclab.tools`, the course's own tools (`gclab bench`,
`gclab gpu-check`).
"""
__version__ = "0.1.0"
