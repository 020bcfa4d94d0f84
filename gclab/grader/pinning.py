"""gclab's own code, made to look up none of its global names while it runs.

A function finds a global name (`all`, `gc`, `_kept_as_data`) in its module's namespace, then in
the builtins, each time it runs; and `gc.collect` in the gc module's namespace.  Any code in the
process can rebind those entries through the module's `__dict__` (the guard lists such a rebinding,
but only one still in place when it looks), so a step that swapped in a `builtins.all` which said
True once and then put the real one back could have passed a leak off as flat.

`pin(modules)` rewrites the bytecode of every function of those modules (their methods, nested
functions and comprehensions included) so that each such name is a constant: what it named when
`pin` ran.  A module's attribute read right after (`gc.collect`, `torch.cuda.memory_allocated`) is
folded in too where it is a function, a class or a module (data, such as `sys.stdout`, is read live),
for the modules `pinned_attributes` allows.  The code keeps its length, its line
numbers and its jump targets: a load and its inline caches become `[PUSH_NULL] LOAD_CONST` and NOPs.
Functions keep their identity (only `__code__` changes), so what refers to them needs no update.

Only where the bytecode is known (CPython 3.11); elsewhere `SUPPORTED` is False and `pin` changes
nothing.
"""
from __future__ import annotations

import dis
import functools
import opcode
import sys
import types

__all__ = ["SUPPORTED", "pin"]

SUPPORTED = sys.version_info[:2] == (3, 11)

_OP = dis.opmap
_CACHES = getattr(opcode, "_inline_cache_entries", ())
# Names a library or the kernel rebinds while the process runs (IPython's excepthook, pytest's
# showwarning): read live, not pinned.
_REBOUND_AT_RUN_TIME = frozenset({"excepthook", "displayhook", "breakpointhook", "unraisablehook",
                                  "showwarning", "formatwarning"})
_PINNABLE_ATTRIBUTES = (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType)


def pin(modules, pinned_attributes=lambda module, name: True) -> int:
    """Pin the global names of every function defined in `modules` (see the module's docstring);
    `pinned_attributes(module, name)`: may `module.name`, read by that code, be pinned too.
    Returns how many functions' code was rewritten (0 where unsupported)."""
    if not SUPPORTED:
        return 0
    namespaces = {id(vars(module)) for module in modules}
    rewritten = 0
    for function in _functions_of(modules, namespaces):
        if _DONE.get(id(function)) is function.__code__:
            continue
        code = _pinned(function.__code__, function.__globals__, function.__builtins__, pinned_attributes)
        if code is not function.__code__:
            function.__code__ = code
            rewritten += 1
        _DONE[id(function)] = code
    return rewritten


_DONE: dict = {}        # id of a function -> the code `pin` left it with: pinned already


def _functions_of(modules, namespaces) -> list:
    """Every function whose globals are one of `namespaces`, reachable from the modules: their
    functions, the members of their classes (methods, properties, static and class methods), what a
    decorator wraps (`__wrapped__`, a closure's cells), a partial's function, and what the modules'
    tuples, frozensets and dicts hold (not their lists and sets: data that grows as they run)."""
    found, seen = [], set()
    pending = [value for module in modules for value in list(vars(module).values())]
    while pending:
        value = pending.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if type(value) is types.FunctionType:
            if id(value.__globals__) in namespaces:
                found.append(value)
                pending += [cell.cell_contents for cell in value.__closure__ or () if _filled(cell)]
                pending += [vars(value).get("__wrapped__")]
        elif isinstance(value, type):
            if id(vars(sys.modules.get(value.__module__, types))) in namespaces:
                pending += list(vars(value).values())
        elif isinstance(value, (staticmethod, classmethod)):
            pending.append(value.__func__)
        elif isinstance(value, property):
            pending += [value.fget, value.fset, value.fdel]
        elif isinstance(value, functools.cached_property):
            pending.append(value.func)
        elif isinstance(value, functools.partial):
            pending.append(value.func)
        elif isinstance(value, (tuple, frozenset)):
            pending += list(value)
        elif isinstance(value, (dict, types.MappingProxyType)):
            pending += list(value.values())
    return found


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _pinned(code: types.CodeType, namespace: dict, builtins: dict, pinned_attributes) -> types.CodeType:
    """`code` (and the code it defines) with its global loads made constants where they resolve now."""
    consts = list(code.co_consts)
    for i, const in enumerate(consts):
        if isinstance(const, types.CodeType):
            consts[i] = _pinned(const, namespace, builtins, pinned_attributes)
    raw = bytearray(code.co_code)
    changed = any(new is not old for new, old in zip(consts, code.co_consts))
    instructions = list(dis.get_instructions(code))
    for start, end, value, pushes_null in _runs(instructions, namespace, builtins, pinned_attributes):
        index = _constant_index(consts, value)
        units = ([(_OP["PUSH_NULL"], 0)] if pushes_null else []) + _with_extended_arg(_OP["LOAD_CONST"], index)
        size = end - start
        if 2 * len(units) > size:
            continue
        units += [(_OP["NOP"], 0)] * (size // 2 - len(units))
        raw[start:end] = bytes(b for unit in units for b in unit)
        changed = True
    if not changed:
        return code
    return code.replace(co_code=bytes(raw), co_consts=tuple(consts))


def _runs(instructions, namespace, builtins, pinned_attributes):
    """(start, end, value, pushes NULL) for each global load, with the module attributes read right
    after it, that can be pinned: `start` and `end` are byte offsets (EXTENDED_ARG prefixes and inline
    caches included)."""
    for position, instruction in enumerate(instructions):
        if instruction.opname != "LOAD_GLOBAL":
            continue
        name = instruction.argval
        if name in namespace:
            value = namespace[name]
        elif name in builtins:
            value = builtins[name]
        else:
            continue
        start = _prefix_start(instructions, position)
        pushes_null, end = bool(instruction.arg & 1), _end_of(instruction)
        for following in instructions[position + 1:]:
            if following.opname not in ("LOAD_ATTR", "LOAD_METHOD") or following.is_jump_target:
                break
            attribute = _attribute(value, following.argval, pinned_attributes)
            if attribute is None or (following.opname == "LOAD_METHOD" and (pushes_null or _on_type(value, following.argval))):
                break
            value, end = attribute, _end_of(following)
            if following.opname == "LOAD_METHOD":
                pushes_null = True
                break
        yield start, end, value, pushes_null


def _attribute(value, name, pinned_attributes):
    """`value.name` if `value` is a module whose attribute `name` may be pinned, else None."""
    if not isinstance(value, types.ModuleType) or name in _REBOUND_AT_RUN_TIME:
        return None
    attribute = vars(value).get(name)
    if not isinstance(attribute, _PINNABLE_ATTRIBUTES) or not pinned_attributes(value, name):
        return None
    return attribute


def _on_type(value, name) -> bool:
    """Does `name` come from the type of `value` (LOAD_METHOD would push it with `value` as self)?"""
    return any(name in vars(kind) for kind in type(value).__mro__)


def _prefix_start(instructions, position) -> int:
    while position and instructions[position - 1].opname == "EXTENDED_ARG":
        position -= 1
    return instructions[position].offset


def _end_of(instruction) -> int:
    return instruction.offset + 2 + 2 * _CACHES[instruction.opcode]


def _constant_index(consts: list, value) -> int:
    for i, const in enumerate(consts):
        if const is value:
            return i
    consts.append(value)
    return len(consts) - 1


def _with_extended_arg(op: int, arg: int) -> list:
    shifts = [shift for shift in (24, 16, 8) if arg >> shift]
    prefix = range(shifts[0], 0, -8) if shifts else ()
    return [(_OP["EXTENDED_ARG"], (arg >> shift) & 0xFF) for shift in prefix] + [(op, arg & 0xFF)]
