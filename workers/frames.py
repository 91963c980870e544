"""A snapshot's frame: a training state as a header (everything but the tensors' bytes,
pickled) and one body of the tensors' bytes, aligned; and back (see snapshot)."""

from __future__ import annotations

import contextlib
import ctypes
import io
import pickle
import random
import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from orchestrator_workers.errors import SnapshotError

if TYPE_CHECKING:
    import torch

_ALIGN = 64


class _Pickler(pickle.Pickler):
    """Pickles a state with its tensors left out (listed in `tensors`, once each)."""

    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors
        self.seen: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> int | None:
        """A tensor's index in `tensors`; None for anything else (pickled as usual)."""
        import torch

        if not isinstance(obj, torch.Tensor):
            return None
        if obj.is_sparse or obj.is_quantized or type(obj) not in (torch.Tensor, torch.nn.Parameter):
            raise SnapshotError(
                f"snapshot.save() takes dense tensors; a {type(obj).__name__} "
                f"({obj.layout}) is in the state: for sharded state (DTensor, FSDP2) use "
                "dcp.save(state, storage_writer=snapshot.writer(step)) (torch.distributed"
                ".checkpoint)"
            )
        index = self.seen.get(id(obj))
        if index is None:
            index = self.seen[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
        return index


def frame(
    step: int, state: Mapping[str, Any], data: Any, world_size: int
) -> tuple[bytes, list[torch.Tensor]]:
    """The header (everything but the tensors' bytes, pickled) and the tensors in order."""
    values = {
        name: value.state_dict() if callable(getattr(value, "state_dict", None)) else value
        for name, value in state.items()
    }
    tensors: list[torch.Tensor] = []
    out = io.BytesIO()
    saved = {"step": step, "data": data, "world_size": world_size, "state": values, "rng": _rng()}
    _Pickler(out, tensors).dump(saved)
    layout = layout_of(tensors)
    return pickle.dumps((out.getvalue(), layout), pickle.HIGHEST_PROTOCOL), tensors


def layout_of(tensors: list[torch.Tensor]) -> tuple[tuple[str, tuple[int, ...], int, int], ...]:
    """(dtype, shape, offset, bytes) of each tensor in the body, aligned."""
    out = []
    offset = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        out.append((str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return tuple(out)


def chunks(tensors: list[torch.Tensor], layout: tuple[Any, ...]) -> Iterator[memoryview]:
    """The body's bytes, tensor by tensor (with the alignment's padding), without a copy
    of tensors already contiguous in CPU memory."""
    written = 0
    for tensor, (_, _, offset, nbytes) in zip(tensors, layout, strict=True):
        if offset > written:
            yield memoryview(bytes(offset - written))
        with bytes_of(tensor) as view:
            yield view
        written = offset + nbytes
    end = layout[-1][2] + layout[-1][3] if layout else 0
    if end > written:
        yield memoryview(bytes(end - written))


@contextlib.contextmanager
def bytes_of(tensor: torch.Tensor) -> Iterator[memoryview]:
    """The tensor's bytes in CPU memory, read in place where it is contiguous there."""
    flat = tensor.detach()
    if flat.device.type != "cpu" or not flat.is_contiguous() or flat.is_conj() or flat.is_neg():
        flat = flat.resolve_conj().resolve_neg().to("cpu").contiguous()
    nbytes = flat.numel() * flat.element_size()
    if nbytes == 0:
        yield memoryview(b"")
        return
    yield memoryview((ctypes.c_char * nbytes).from_address(flat.data_ptr())).cast("B")
    del flat  # kept alive until here: the view reads its memory


def unpack(header: bytes, body: bytearray) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """What a frame saved, its tensors views of `body` (nothing copied), and its layout."""
    import torch

    skeleton, layout = pickle.loads(header)  # noqa: S301 - this rank's own, or its buddy's over the job's authenticated channel
    views = []
    for dtype_name, shape, offset, nbytes in layout:
        dtype = getattr(torch, dtype_name)
        if nbytes == 0:
            views.append(torch.empty(shape, dtype=dtype))
            continue
        raw = torch.frombuffer(body, dtype=torch.uint8, count=nbytes, offset=offset)
        views.append(raw.view(dtype).view(shape))

    class _Unpickler(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:
            return views[pid]

    return _Unpickler(io.BytesIO(skeleton)).load(), tuple(layout)


def load(saved: dict[str, Any], state: Mapping[str, Any]) -> dict[str, Any]:
    """Load what a frame saved (see unpack) into `state`'s objects, and say what was
    loaded, by name (the RNGs: see set_rng).

    A module's state and a tensor are copied into them in place; so is an optimizer's
    (any object with `state_dict` and `load_state_dict`): into the tensors its
    `state_dict()` holds now, where they have the saved shape and dtype, else into new
    copies, since its `load_state_dict` keeps what it is given. Plain values are loaded as
    copies: nothing loaded or returned shares the snapshot's memory.
    """
    import torch

    loaded = dict(saved["state"])
    for name, got in loaded.items():
        value: Any = state.get(name)
        if isinstance(value, torch.nn.Module):
            value.load_state_dict(got)
            loaded[name] = value.state_dict()
        elif _same_kind(value, got):
            with torch.no_grad():
                value.copy_(got)
            loaded[name] = value
        elif callable(getattr(value, "load_state_dict", None)):
            now = value.state_dict() if callable(getattr(value, "state_dict", None)) else None
            with torch.no_grad():
                loaded[name] = _copied(got, now)
            value.load_state_dict(loaded[name])
        else:
            loaded[name] = _copied(got)
    return loaded


def _same_kind(value: Any, got: Any) -> bool:
    """Whether `got` can be copied into tensor `value` in place."""
    import torch

    return (
        isinstance(value, torch.Tensor)
        and isinstance(got, torch.Tensor)
        and value.shape == got.shape
        and value.dtype == got.dtype
    )


def _copied(value: Any, into: Any = None) -> Any:
    """`value` with every tensor in it (in dicts, lists, tuples) copied: into the tensor at
    the same place in `into` where it has the same shape and dtype, else into a new one."""
    import torch

    if isinstance(value, torch.Tensor):
        if _same_kind(into, value):
            return into.copy_(value)
        return value.clone()
    if isinstance(value, dict):
        into = into if isinstance(into, dict) else {}
        return {k: _copied(v, into.get(k)) for k, v in value.items()}
    if not isinstance(value, (list, tuple)):
        return value
    same = isinstance(into, (list, tuple)) and len(into) == len(value)
    items = [_copied(v, into[i] if same else None) for i, v in enumerate(value)]
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
        return type(value)(*items)
    return type(value)(items)


def _rng() -> dict[str, Any]:
    import torch

    numpy = sys.modules.get("numpy")
    return {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        "numpy": numpy.random.get_state() if numpy is not None else None,
    }


def set_rng(states: dict[str, Any]) -> None:
    """Set the RNGs back to what a frame saved."""
    import torch

    random.setstate(states["python"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None:
        torch.cuda.set_rng_state_all(states["cuda"])
    numpy = sys.modules.get("numpy")
    if states["numpy"] is not None and numpy is not None:
        numpy.random.set_state(states["numpy"])
