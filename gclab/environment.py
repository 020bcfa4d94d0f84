"""The environment variables as they were when gclab was first imported.

A process that runs graded code imports gclab before any of that code runs, and the processes gclab
starts on its behalf (the model server, its load generator, Graphviz) get this environment, so that a
variable the code being run set (PATH, LD_PRELOAD, PYTHONPATH) does not reach them."""
import os

_STARTING_ENVIRONMENT = tuple(os.environ.items())


def starting_environment() -> dict:
    return dict(_STARTING_ENVIRONMENT)
