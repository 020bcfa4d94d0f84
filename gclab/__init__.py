"""gclab: the helper package of the course on Python garbage collection and GPU memory.

Modules: `memory` (the tensor-memory Meter), `gcwatch` (collections seen through
gc.callbacks), `plots` (timelines), `checks` (self-checks and hidden-test helpers),
`refs` (who holds an object), `cycles` (object graphs drawn offline, what a collection finds),
`serving` (a model server and an open-loop load generator), `grading` (the `gclab
grade` command).
"""
__version__ = "0.1.0"
