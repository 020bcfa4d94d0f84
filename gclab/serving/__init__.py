"""A small model server and an open-loop load generator, to watch collector pauses hit requests;
and requests served in this process with the collector's CPU time charged to each.

    with ModelServer(heap_objects=300_000, attribution="objects", policy="my_policy.py") as server:
        load = run_load(server.url, rate=200, duration=4.0)
        trace = server.trace()
    load.percentiles()               # latency in ms at P50, P95, P99 and the maximum
    trace.collections_inside_requests(generation=2)

One idea per module, each saying what it measures and what it cannot see:

- `server`     the model server process: a torch model behind HTTP that records every request and
               every collection, and loads a GC policy (its hooks: see there)
- `load`       the load generator process: an open-loop schedule of requests, with the collector off
- `trace`      what the server recorded, read from the notebook (`Trace`, `ServedCollection`)
- `runs`       the notebook's side: `ModelServer`, `run_load`, `measure`, `compare`, `spread`
- `inline`     serving in this process, one request after another (`serve_inline`), and the rules a
               served run is held to (`assert_served`)
- `processes`  how servers and loads are started (`python -m gclab.serving`, forked from a zygote)

Lessons import the names below from `gclab.serving` itself.
"""
from .inline import InlineRun, _full_collections, _full_collections_unwatched, assert_served, serve_inline
from .load import LoadResult, load_main, schedule
from .processes import _ZYGOTE, _python_module, _spawn, _zygote, forked, main, main_parser, preload, prestart
from .runs import ModelServer, ServedRun, compare, load_rows, measure, run_load, spread
from .server import (ATTRIBUTION, HEAP_OBJECTS, HOOKS, READY, Explanation, Model, ResponseCache, ServerState,
                     TokenScore, _recorder, _serialized, build_app, full_collection_cpu, load_policy,
                     long_lived_heap, serve)
from .trace import ServedCollection, Trace

__all__ = ["ModelServer", "LoadResult", "Trace", "ServedRun", "ServedCollection", "measure", "compare", "spread",
           "run_load", "schedule", "InlineRun", "serve_inline", "assert_served", "full_collection_cpu",
           "long_lived_heap", "prestart"]
