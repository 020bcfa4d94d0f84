"""gclab: the helper package of the course on Python garbage collection and GPU memory.

Modules: `memory` (the tensor-memory Meter), `gcwatch` (collections seen through
gc.callbacks), `plots` (timelines), `checks` (self-checks and hidden-test helpers),
`refs` (who holds an object), `held` (which attribute of an object keeps the bytes), `cycles` (object graphs drawn offline, what a collection finds),
`serving` (a model server, an open-loop load generator, and requests served in this
process with the collector's CPU time charged to each), `widgets` (controls that redraw a
figure, a live memory gauge, a picker that adds runs to a comparison), `course` (where the
course lives, for Colab, and its kernel), `grading` (the `gclab grade` command).
"""
__version__ = "0.1.0"
