"""aitoolbox's reader of pickles from storage: it builds only what its caller's table allows, and calls nothing else.

Python's ``pickle`` calls whatever function a file names. This reader is a pickle machine of its own (every
opcode of protocols 0 to 5 that plain data needs), in the manner of torch's ``weights_only`` unpickler, but
without any process-wide state: each load is given its table of allowed globals, and nothing another thread
does changes what a load accepts.

- A global (``GLOBAL``, ``STACK_GLOBAL``, ``INST``, ``OBJ``) is looked up in the caller's table only, never
  imported; a name that is not there is refused (:class:`Refused`, which lists it).
- Calling (``REDUCE``) and creating objects (``NEWOBJ``) is possible only for the table's :class:`Allowed`
  entries, which are the caller's own functions: they check their arguments and build the value from plain data.
- Setting an object's state (``BUILD``) goes to the caller's ``build`` function, which accepts the few types it
  knows; there is no ``__setstate__`` call of the file's choosing.
- Lists, dicts and sets are filled only when they are exactly lists, dicts and sets; copyreg extension codes and
  out-of-band buffers are refused.

Every other failure (truncated data, an unknown opcode, a wrong argument) is :class:`Malformed`.
:func:`~aitoolbox.experiment.local_save.object_bounds.check_shape` then bounds what was built: nesting depth, cycles, and how many objects a walk over it meets
(a pickle can reference one list from many places, which a naive walk multiplies).
"""
import codecs
import collections
import contextvars
import reprlib
import struct
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

# Python 2's module and class names, mapped as pickle.Unpickler(fix_imports=True) maps them (protocols 0-2).
from _compat_pickle import IMPORT_MAPPING, NAME_MAPPING


class _Short(reprlib.Repr):
    """Short text of a value read from a file, for messages: containers cut short, other objects by their type only
    (their own ``repr`` could be huge, recurse deeply, or run code of theirs)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxlong, self.maxother = 3, 60, 40, 60

    def repr_instance(self, value: Any, level: int) -> str:
        return f"<{type(value).__name__}>"


def short(value: Any) -> str:
    """A short, safe text of ``value`` (a value read from a file) for an error message."""
    try:
        return _Short().repr(value)
    except Exception:  # noqa: BLE001 - a message must never fail
        return f"<{type(value).__name__}>"


# Keys whose hash a file can choose (floats, tuples, frozensets), by hash, for the load under way: see check_key.
_KEYS_BY_HASH: "contextvars.ContextVar[Optional[Dict[int, set]]]" = contextvars.ContextVar(
    "aitoolbox_pickle_keys_by_hash", default=None)
# How many distinct such keys of one file may share a hash: real keys almost never share one.
MAX_SHARED_HASH = 32


def check_key(key: Any) -> Any:
    """``key`` for a dict or set built from a file: not an int of more than 60 bits nor a complex number (nor a
    tuple holding one), and, during a load, not one of more than :data:`MAX_SHARED_HASH` distinct float, tuple or
    frozenset keys of the file sharing one hash.

    Python hashes such ints modulo 2**61 - 1, so a file can hold thousands of distinct ones with one hash (complex
    numbers combine two hashes the file chooses), and building a dict of them takes time quadratic in their number
    (minutes for a file of a megabyte). Floats are hashed the same way (``3.0`` and ``3.0 * 2**61`` share a hash),
    and tuples combine their items' hashes, so those are counted by hash instead of refused: a hyperparameter dict
    may have float keys. Strings and bytes are hashed with a secret seed; checkpoints use those, and small ints, as
    keys.
    """
    if (type(key) is int and key.bit_length() > 60) or isinstance(key, complex):
        raise Malformed("a dict or set key is an integer of more than 60 bits or a complex number (a "
                        "hash-collision attack?)")
    if type(key) in (tuple, frozenset):
        for item in key:
            check_key(item)
    if type(key) in (float, tuple, frozenset):
        by_hash = _KEYS_BY_HASH.get()
        if by_hash is not None:
            sharing = by_hash.setdefault(hash(key), set())
            sharing.add(key)  # at most MAX_SHARED_HASH + 1 keys compared: bounded
            if len(sharing) > MAX_SHARED_HASH:
                raise Malformed(f"more than {MAX_SHARED_HASH} distinct dict or set keys share one hash ("
                                f"{short(key)} among them): a hash-collision attack?")
    return key


class Refused(Exception):
    """The pickle names globals outside the table (nothing was called)."""

    def __init__(self, names: List[str]):
        self.names = names
        super().__init__(", ".join(names))


class Malformed(Exception):
    """The pickle is truncated, damaged, or uses what plain data never needs."""


class Unavailable(Exception):
    """The data is sound but cannot be built here (its tensors were saved on a device this machine lacks)."""


class CallerError(Exception):
    """An exception of the caller's own code (e.g. a ``map_location`` function), raised unchanged by the caller."""

    def __init__(self, error: BaseException):
        self.error = error
        super().__init__(str(error))


class Allowed:
    """A global a pickle may name, as the reader sees it.

    Args:
        name: ``module.name``, for messages.
        call: what calling it builds (``REDUCE``), given the pickled arguments; None: it cannot be called.
        new: what creating an instance builds (``NEWOBJ``); defaults to ``call``.
    """

    def __init__(self, name: str, call: Optional[Callable[..., Any]] = None,
                 new: Optional[Callable[..., Any]] = None):
        self.name = name
        self.call = call
        self.new = new or call

    def __repr__(self) -> str:
        return f"<allowed {self.name}>"


BuildFunction = Callable[[Any, Any], Any]
_MARK = object()  # not pushed: MARK positions are kept apart, as in CPython's pickle module


class RestrictedUnpickler:
    """A pickle reader over ``data`` that builds only what ``table`` allows.

    Args:
        data: the whole pickle.
        table: ``(module, name) -> value``. An :class:`Allowed` value can be called or instantiated by the pickle;
            any other value (a torch dtype, a constant) is only pushed.
        persistent_load: given a persistent id, returns the object (torch's storages); None: none allowed.
        build: given ``(instance, state)`` for ``BUILD``, sets the state and returns None, or returns the object
            that replaces the instance; raises :class:`Malformed` for types it does not know. None: no BUILD.
        encoding: how Python 2 ``str`` values (protocol 0-2 ``STRING`` opcodes) are decoded.
        stored_size: how many bytes the pickle takes in its file (less than ``len(data)`` when it was compressed);
            what it may build is bounded by this (default: ``len(data)``).
    """

    def __init__(self, data: bytes, table: Mapping[Tuple[str, str], Any],
                 persistent_load: Optional[Callable[[Any], Any]] = None, build: Optional[BuildFunction] = None,
                 encoding: str = "utf-8", stored_size: Optional[int] = None):
        self._data = bytes(data)
        self._table = table
        self._persistent_load = persistent_load
        self._build = build
        self._encoding = encoding
        self._pos = 0
        self._proto = 0
        stored = len(self._data) if stored_size is None else min(stored_size, len(self._data))
        # A container costs 50 to 200 bytes of memory and can cost one byte of pickle: their number is bounded by
        # the pickle's size in its file (a checkpoint has one in about every 20 bytes of it, a list of pairs one in
        # 12), so the memory a pickle can take is a bounded multiple of what the file holds, compressed or not.
        self._max_containers = 100_000 + stored // 8
        self._containers_left = self._max_containers
        # A memo entry costs about 100 bytes and one byte of pickle (MEMOIZE): bounded the same way. A real pickle
        # memoizes one object in every 4 bytes at most (a string or a tuple takes more than a byte to build).
        self._max_memo = 1_000_000 + stored // 4
        self._stack: List[Any] = []
        self._marks: List[int] = []
        self._memo: Dict[int, Any] = {}

    # --- reading ---------------------------------------------------------------------------------------------
    def _read(self, size: int) -> bytes:
        end = self._pos + size
        if size < 0 or end > len(self._data):
            raise Malformed(f"truncated: an opcode at byte {self._pos} needs {size} bytes, "
                            f"{len(self._data) - self._pos} remain")
        chunk = self._data[self._pos:end]
        self._pos = end
        return chunk

    def _byte(self) -> int:
        if self._pos >= len(self._data):
            raise Malformed("truncated: it ends before its STOP opcode")
        self._pos += 1
        return self._data[self._pos - 1]

    def _unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self._read(struct.calcsize(fmt)))[0]

    def _readline(self) -> bytes:
        end = self._data.find(b"\n", self._pos)
        if end < 0:
            raise Malformed(f"truncated: a line at byte {self._pos} has no end")
        line = self._data[self._pos:end]
        self._pos = end + 1
        return line

    def load(self) -> Any:
        """The object the pickle describes. Raises :class:`Refused` or :class:`Malformed`."""
        dispatch = self._dispatch()
        token = _KEYS_BY_HASH.set({})
        try:
            while True:
                opcode = self._byte()
                handler = dispatch.get(opcode)
                if handler is None:
                    raise Malformed(f"opcode {bytes([opcode])!r} at byte {self._pos - 1} is not one plain data "
                                    "needs (or not a pickle opcode)")
                if handler():
                    if len(self._stack) != 1:
                        raise Malformed("the pickle ends with a stack of other than one object")
                    return self._stack.pop()
        except (Refused, Malformed, Unavailable, CallerError):
            raise
        except RecursionError:
            raise Malformed("nested too deeply to build") from None
        except Exception as error:  # a wrong argument to an allowed function, a bad memo index, an empty stack...
            raise Malformed(f"{type(error).__name__} at byte {self._pos}: {error}") from error
        finally:
            _KEYS_BY_HASH.reset(token)

    # --- the machine ------------------------------------------------------------------------------------------
    def _dispatch(self) -> Dict[int, Callable[[], Optional[bool]]]:
        simple = {
            b"N": lambda: self._push(None), b"\x88": lambda: self._push(True), b"\x89": lambda: self._push(False),
            b")": lambda: self._push(()), b"]": lambda: self._push(self._counted([])),
            b"}": lambda: self._push(self._counted({})), b"\x8f": lambda: self._push(self._counted(set())),
            b"J": lambda: self._push(self._unpack("<i")), b"K": lambda: self._push(self._byte()),
            b"M": lambda: self._push(self._unpack("<H")), b"G": lambda: self._push(self._unpack(">d")),
            b"\x8a": lambda: self._push(int.from_bytes(self._read(self._byte()), "little", signed=True)),
            b"\x8b": lambda: self._push(int.from_bytes(self._read(self._count("<i")), "little", signed=True)),
            b"I": self._int_line, b"L": lambda: self._push(int(self._readline().rstrip(b"L") or b"0")),
            b"F": lambda: self._push(float(self._readline())),
            b"X": lambda: self._push(str(self._read(self._count("<I")), "utf-8", "surrogatepass")),
            b"\x8c": lambda: self._push(str(self._read(self._byte()), "utf-8", "surrogatepass")),
            b"\x8d": lambda: self._push(str(self._read(self._count("<Q")), "utf-8", "surrogatepass")),
            b"V": lambda: self._push(str(self._readline(), "raw-unicode-escape")),
            b"B": lambda: self._push(bytes(self._read(self._count("<I")))),
            b"C": lambda: self._push(bytes(self._read(self._byte()))),
            b"\x8e": lambda: self._push(bytes(self._read(self._count("<Q")))),
            b"\x96": lambda: self._push(bytearray(self._read(self._count("<Q")))),
            b"T": lambda: self._push(self._py2_string(bytes(self._read(self._count("<i"))))),
            b"U": lambda: self._push(self._py2_string(bytes(self._read(self._byte())))),
            b"S": self._string_line,
            b"(": self._mark, b"0": self._pop, b"1": self._pop_mark, b"2": lambda: self._push(self._stack[-1]),
            b"t": lambda: self._push(self._counted(tuple(self._pop_to_mark()))), b"\x85": lambda: self._tuple(1),
            b"\x86": lambda: self._tuple(2), b"\x87": lambda: self._tuple(3),
            b"l": lambda: self._push(self._counted(self._pop_to_mark())), b"d": self._dict_from_mark,
            b"a": self._append, b"e": self._appends, b"s": self._setitem, b"u": self._setitems,
            b"\x90": self._additems, b"\x91": lambda: self._push(self._counted(frozenset(map(check_key, self._pop_to_mark())))),
            b"g": lambda: self._get(int(self._readline())), b"h": lambda: self._get(self._byte()),
            b"j": lambda: self._get(self._unpack("<I")),
            b"p": lambda: self._put(int(self._readline())), b"q": lambda: self._put(self._byte()),
            b"r": lambda: self._put(self._unpack("<I")), b"\x94": lambda: self._put(len(self._memo)),
            b"c": self._global_line, b"\x93": self._stack_global, b"i": self._inst, b"o": self._obj,
            b"R": self._reduce, b"\x81": self._newobj, b"\x92": self._newobj_ex, b"b": self._build_state,
            b"P": lambda: self._persistent(self._readline().decode("ascii")),
            b"Q": lambda: self._persistent(self._stack.pop()),
            b"\x80": self._protocol, b"\x95": lambda: self._read(8) and None,
            b"\x82": lambda: self._extension(self._byte()), b"\x83": lambda: self._extension(self._unpack("<H")),
            b"\x84": lambda: self._extension(self._unpack("<i")),
            b".": lambda: True,
        }
        return {code[0]: handler for code, handler in simple.items()}

    def _push(self, value: Any) -> None:
        self._stack.append(value)

    def _counted(self, container: Any) -> Any:
        self._containers_left -= 1
        if self._containers_left < 0:
            raise Malformed(f"it builds more containers than {self._max_containers} (its size allows): a "
                            "memory bomb?")
        return container

    def _count(self, fmt: str) -> int:
        count = self._unpack(fmt)
        if count < 0 or count > len(self._data) - self._pos:
            raise Malformed(f"truncated: a value at byte {self._pos} states {count} bytes, "
                            f"{len(self._data) - self._pos} remain")
        return count

    def _py2_string(self, raw: bytes) -> Any:
        return raw if self._encoding == "bytes" else raw.decode(self._encoding)

    def _int_line(self) -> None:
        line = self._readline()
        self._push(False if line == b"00" else True if line == b"01" else int(line))

    def _string_line(self) -> None:
        line = self._readline()
        if len(line) < 2 or line[0] != line[-1] or line[:1] not in (b'"', b"'"):
            raise Malformed("a protocol-0 string is not quoted")
        self._push(self._py2_string(codecs.escape_decode(line[1:-1])[0]))  # type: ignore[attr-defined]

    def _mark(self) -> None:
        self._marks.append(len(self._stack))

    def _pop_to_mark(self) -> list:
        if not self._marks:
            raise Malformed("an opcode needs a MARK and there is none")
        start = self._marks.pop()
        items = self._stack[start:]
        del self._stack[start:]
        return items

    def _pop(self) -> None:
        if self._marks and self._marks[-1] == len(self._stack):
            self._marks.pop()  # POP of a MARK, as CPython's pickle allows
        else:
            self._stack.pop()

    def _pop_mark(self) -> None:
        self._pop_to_mark()

    def _tuple(self, size: int) -> None:
        if len(self._stack) < size:
            raise Malformed("stack underflow")
        items = tuple(self._stack[len(self._stack) - size:])
        del self._stack[len(self._stack) - size:]
        self._push(self._counted(items))

    def _dict_from_mark(self) -> None:
        items = self._pop_to_mark()
        if len(items) % 2:
            raise Malformed("a dict of an odd number of items")
        self._push(self._counted({check_key(items[i]): items[i + 1] for i in range(0, len(items), 2)}))

    def _target(self, kinds: tuple, what: str) -> Any:
        target = self._stack[-1]
        if type(target) not in kinds:
            raise Malformed(f"{what} into a {type(target).__name__}")
        return target

    def _append(self) -> None:
        item = self._stack.pop()
        self._target((list,), "APPEND").append(item)

    def _appends(self) -> None:
        items = self._pop_to_mark()
        self._target((list,), "APPENDS").extend(items)

    def _setitem(self) -> None:
        value = self._stack.pop()
        key = self._stack.pop()
        self._target((dict, collections.OrderedDict, collections.Counter), "SETITEM")[check_key(key)] = value

    def _setitems(self) -> None:
        items = self._pop_to_mark()
        if len(items) % 2:
            raise Malformed("SETITEMS of an odd number of items")
        target = self._target((dict, collections.OrderedDict, collections.Counter), "SETITEMS")
        for i in range(0, len(items), 2):
            target[check_key(items[i])] = items[i + 1]

    def _additems(self) -> None:
        items = self._pop_to_mark()
        self._target((set,), "ADDITEMS").update(check_key(item) for item in items)

    def _get(self, index: int) -> None:
        if index not in self._memo:
            raise Malformed(f"memo entry {index} is read before it is written")
        self._push(self._memo[index])

    def _put(self, index: int) -> None:
        if index < 0:
            raise Malformed("negative memo index")
        if index not in self._memo and len(self._memo) >= self._max_memo:
            raise Malformed(f"it memoizes more objects than {self._max_memo} (its size allows): a memory bomb?")
        self._memo[index] = self._stack[-1]

    def _protocol(self) -> None:
        self._proto = self._byte()
        if self._proto > 5:
            raise Malformed(f"pickle protocol {self._proto} is newer than 5")

    def _lookup(self, module: str, name: str) -> Any:
        if not isinstance(module, str) or not isinstance(name, str):
            raise Malformed("a global named by other than two strings")
        if self._proto < 3:
            if (module, name) in NAME_MAPPING:
                module, name = NAME_MAPPING[(module, name)]
            elif module in IMPORT_MAPPING:
                module = IMPORT_MAPPING[module]
        try:
            return self._table[(module, name)]
        except KeyError:
            raise Refused([f"{module}.{name}"]) from None

    def _global_line(self) -> None:
        module = self._readline().decode("utf-8")
        self._push(self._lookup(module, self._readline().decode("utf-8")))

    def _stack_global(self) -> None:
        name = self._stack.pop()
        module = self._stack.pop()
        self._push(self._lookup(module, name))

    def _allowed(self, value: Any, use: str) -> Allowed:
        if not isinstance(value, Allowed) or getattr(value, use) is None:
            raise Malformed(f"{'calls' if use == 'call' else 'creates an object of'} {short(value)}, which plain data "
                            "never does")
        return value

    def _reduce(self) -> None:
        args = self._stack.pop()
        if type(args) is not tuple:
            raise Malformed("REDUCE with arguments that are not a tuple")
        self._stack[-1] = self._allowed(self._stack[-1], "call").call(*args)

    def _newobj(self) -> None:
        args = self._stack.pop()
        cls = self._stack.pop()
        if type(args) is not tuple:
            raise Malformed("NEWOBJ with arguments that are not a tuple")
        self._push(self._allowed(cls, "new").new(*args))

    def _newobj_ex(self) -> None:
        kwargs = self._stack.pop()
        args = self._stack.pop()
        cls = self._stack.pop()
        if type(args) is not tuple or type(kwargs) is not dict or not all(isinstance(k, str) for k in kwargs):
            raise Malformed("NEWOBJ_EX with arguments that are not a tuple and a dict")
        self._push(self._allowed(cls, "new").new(*args, **kwargs))

    def _inst(self) -> None:
        module = self._readline().decode("utf-8")
        cls = self._lookup(module, self._readline().decode("utf-8"))
        self._push(self._allowed(cls, "new").new(*self._pop_to_mark()))

    def _obj(self) -> None:
        items = self._pop_to_mark()
        if not items:
            raise Malformed("OBJ without a class")
        self._push(self._allowed(items[0], "new").new(*items[1:]))

    def _build_state(self) -> None:
        state = self._stack.pop()
        instance = self._stack[-1]
        if self._build is None:
            raise Malformed(f"sets the state of a {type(instance).__name__}, which this file never holds")
        replacement = self._build(instance, state)
        if replacement is not None and replacement is not instance:
            self._stack[-1] = replacement
            for index, value in list(self._memo.items()):  # rare (a numpy dtype of another byte order)
                if value is instance:
                    self._memo[index] = replacement

    def _persistent(self, pid: Any) -> None:
        if self._persistent_load is None:
            raise Malformed("holds a persistent reference, which this file never holds")
        self._push(self._persistent_load(pid))

    def _extension(self, code: int) -> None:
        raise Refused([f"copyreg extension code {code}"])
