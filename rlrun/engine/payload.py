"""SGLang-compatible flattened-bucket weight payloads.

A payload is what SGLang 0.5.23's ``update_weights_from_tensor(load_format="flattened_bucket")``
unpickles on one TP rank: ForkingPickler bytes of ::

    {"flattened_tensor": uint8 tensor,                 # every tensor's bytes, concatenated
     "metadata": [SimpleNamespace(name, shape, dtype, start_idx, end_idx, numel), ...]}

``start_idx``/``end_idx``/``numel`` count bytes of the flat uint8 tensor (as in SGLang's
``FlattenedTensorBucket``), so mixed dtypes share one buffer. ``types.SimpleNamespace`` is on
SGLang's unpickling allowlist, so building payloads needs no ``import sglang``.

Transport hazards (why the RPC only accepts payloads on local sockets):
* ForkingPickler does not copy tensor data: a CPU tensor travels as a shared-memory file descriptor
  fetched from the sender's ``multiprocessing.resource_sharer`` (authenticated with the process
  ``authkey``, which the engine client hands to its worker), a CUDA tensor as a CUDA IPC handle.
  The sender must keep the bucket alive until the receiver has unpickled it.
* A payload can be unpickled once: the descriptor is handed over on the first load.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import pickletools
import types
from collections.abc import Iterable, Iterator
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's tensor reductions with ForkingPickler)

NamedTensors = list[tuple[str, torch.Tensor]]

ALIGN_BYTES = 16
"""Start offset alignment of every tensor in a flat buffer (>= the largest element size)."""

_TORCH_DTYPES = (
    "bcomplex32 bfloat16 bit bits16 bits1x8 bits2x4 bits4x2 bits8 bool cdouble cfloat chalf complex128 "
    "complex32 complex64 double float float16 float32 float4_e2m1fn_x2 float64 float8_e4m3fn "
    "float8_e4m3fnuz float8_e5m2 float8_e5m2fnuz float8_e8m0fnu half int int1 int16 int2 int3 int32 "
    "int4 int5 int6 int64 int7 int8 long qint32 qint8 quint2x4 quint4x2 quint8 short uint1 uint16 uint2 "
    "uint3 uint32 uint4 uint5 uint6 uint64 uint7 uint8"
).split()
_TENSOR_KINDS = "BFloat16 Bool Byte Char Double Float Half Int Long Short".split()
_STORAGE_KINDS = _TENSOR_KINDS + "ComplexDouble ComplexFloat QInt32 QInt8 QUInt2x4 QUInt4x2 QUInt8".split()

# Mirror of sglang 0.5.23 ``srt/utils/common.py`` SafeUnpickler.ALLOWED_GLOBALS, regrouped by module.
# Keeping the same set means a payload that passes here passes in SGLang, and a payload carrying any
# other class (say, a metadata dataclass defined in rlrun) fails here in CI exactly as it would there.
SGLANG_ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    [
        ("builtins", n)
        for n in "bool bytearray bytes complex dict float frozenset int list range set slice str tuple".split()
    ]
    + [("collections", n) for n in ("OrderedDict", "defaultdict", "deque", "Counter")]
    + [("copyreg", "__newobj__"), ("copyreg", "__newobj_ex__"), ("functools", "partial")]
    + [("itertools", "chain"), ("itertools", "repeat"), ("_codecs", "encode"), ("types", "SimpleNamespace")]
    + [("multiprocessing.reduction", "_rebuild_partial"), ("multiprocessing.reduction", "_rebuild_socket")]
    + [("multiprocessing.resource_sharer", "DupFd")]
    + [("torch", "Tensor")]
    + [(m, f"{k}Tensor") for m in ("torch", "torch.cuda") for k in _TENSOR_KINDS]
    + [(m, f"{k}Tensor") for m in ("torch.sparse", "torch.cuda.sparse") for k in _TENSOR_KINDS if k != "Bool"]
    + [("torch", n) for n in ["Size", "device", "dtype", "UntypedStorage", *_TORCH_DTYPES]]
    + [("torch", f"{k}Storage") for k in _STORAGE_KINDS]
    + [("torch.cuda", f"{k}Storage") for k in _STORAGE_KINDS if not k.startswith("Q")]
    + [
        ("torch", n)
        for n in (
            "per_tensor_affine",
            "per_tensor_symmetric",
            "per_channel_affine",
            "per_channel_symmetric",
            "per_channel_affine_float_qparams",
        )
    ]
    + [("torch.nn.parameter", "Parameter"), ("torch.serialization", "_get_layout")]
    + [("torch.storage", n) for n in ("UntypedStorage", "_UntypedStorage", "TypedStorage")]
    + [("torch._tensor", "_rebuild_from_type_v2")]
    + [
        ("torch._utils", f"_rebuild_{n}")
        for n in (
            "tensor",
            "tensor_v2",
            "tensor_v3",
            "parameter",
            "parameter_with_state",
            "qtensor",
            "sparse_tensor",
            "meta_tensor_no_storage",
            "wrapper_subclass",
            "device_tensor_from_numpy",
            "device_tensor_from_cpu_tensor",
        )
    ]
    + [
        ("torch.multiprocessing.reductions", f"rebuild_{n}")
        for n in (
            "tensor",
            "meta_tensor",
            "cuda_tensor",
            "nested_tensor",
            "sparse_coo_tensor",
            "sparse_compressed_tensor",
            "storage_fd",
            "storage_filename",
            "storage_empty",
            "typed_storage",
            "typed_storage_child",
        )
    ]
    + [("torch_npu.multiprocessing.reductions", "rebuild_npu_tensor")]
    + [
        ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
        ("sglang.srt.utils.patch_torch", "_rebuild_npu_tensor_modified"),
    ]
    + [
        ("sglang.srt.managers.io_struct", "GenerateReqInput"),
        ("sglang.srt.managers.io_struct", "EmbeddingReqInput"),
        ("sglang.srt.disaggregation.encoder.receiver", "EmbeddingData"),
        ("sglang.srt.managers.schedule_batch", "Modality"),
        ("sglang.srt.multimodal.modality", "Modality"),
        ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
        ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorBucket"),
        ("sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor"),
        ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"),
    ]
)


def _load_storage_weights_only(data: bytes):
    """What SGLang substitutes for ``torch.storage._load_from_bytes`` (emitted when a tensor is
    pickled with plain pickle): a ``weights_only`` torch.load that must yield a storage."""
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, (torch.storage.TypedStorage, torch.UntypedStorage)):
        raise pickle.UnpicklingError(f"Expected a Torch storage, got {type(storage).__name__}")
    return storage


class _SafeUnpickler(pickle.Unpickler):
    """Resolves only allowlisted globals, with SGLang's error message for the rest."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _load_storage_weights_only
        if (module, name) in SGLANG_ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")


_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING", "SHORT_BINSTRING"}
_NO_PUSH_OPS = {"MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT", "FRAME", "PROTO"}


def payload_globals(payload: bytes) -> list[tuple[str, str]]:
    """The ``(module, name)`` globals a pickle would import, read from its opcodes without running
    it (nothing is unpickled, so the payload's file descriptors stay unclaimed). A ``STACK_GLOBAL``
    whose operands are not plain strings is reported as ``("?", "?")``."""
    found: list[tuple[str, str]] = []
    recent: list[str | None] = []  # values pushed most recently: STACK_GLOBAL takes the last two
    memo: dict[int, str | None] = {}
    for op, arg, _ in pickletools.genops(payload):
        if op.name in ("GLOBAL", "INST"):
            global_module, _, global_name = str(arg).partition(" ")  # GLOBAL / INST: "module name"
            found.append((global_module, global_name))
            recent.append(None)
        elif op.name == "STACK_GLOBAL":
            module, name = (recent[-2], recent[-1]) if len(recent) >= 2 else (None, None)
            found.append((module, name) if isinstance(module, str) and isinstance(name, str) else ("?", "?"))
            recent.append(None)
        elif op.name == "MEMOIZE":
            memo[len(memo)] = recent[-1] if recent else None
        elif op.name in ("PUT", "BINPUT", "LONG_BINPUT") and isinstance(arg, int):
            memo[arg] = recent[-1] if recent else None
        elif op.name in ("GET", "BINGET", "LONG_BINGET") and isinstance(arg, int):
            recent.append(memo.get(arg))
        elif op.name in _STRING_OPS:
            recent.append(arg if isinstance(arg, str) else None)
        elif op.name not in _NO_PUSH_OPS:
            recent.append(None)
    return found


def serialize_flattened_bucket(named_tensors: NamedTensors) -> bytes:
    """Pack ``(hf_name, full_tensor)`` pairs into one flattened-bucket payload (mixed dtypes ok).

    Each tensor starts at a multiple of ``ALIGN_BYTES``: the receiver (SGLang's
    ``FlattenedTensorBucket.reconstruct_tensors`` too) ``view``s each byte slice as its dtype, which
    fails at an offset that is not a multiple of the element size. The flat buffer is a fresh
    allocation, so the payload never aliases trainer parameters.
    """
    return serialize_for_tp_ranks(named_tensors, 1)[0]


def serialize_for_tp_ranks(named_tensors: NamedTensors, tp_size: int) -> list[bytes]:
    """One flattened-bucket payload per engine TP rank, all over the same flat buffer.

    SGLang's TP rank r unpickles only entry r and loads full tensors (it shards them itself). Host
    tensors can share one buffer (each entry is pickled separately because a payload's file
    descriptor can be claimed only once); CUDA ones cannot: TP rank r must get memory on its own GPU
    (SGLang's TP rank 1 fails copying from a buffer on GPU 0), so an engine group builds payload r on
    group rank r instead (rlrun/engine/group.py).
    """
    if tp_size < 1:
        raise ValueError(f"tp_size ({tp_size}) must be >= 1 because every engine has at least one TP rank")
    if tp_size > 1 and any(tensor.is_cuda for _, tensor in named_tensors):
        raise ValueError(
            f"named_tensors must be on the host for tp_size ({tp_size}) > 1 because each SGLang TP "
            "rank needs its payload on its own GPU; sync through rlrun.engine.group.EngineGroup, "
            "which builds payload r on group rank r"
        )
    bucket = _flatten(named_tensors)
    payloads = []
    for _ in range(tp_size):
        buf = io.BytesIO()
        ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(bucket)
        payloads.append(buf.getvalue())
    return payloads


def _flatten(named_tensors: NamedTensors) -> dict:
    """SGLang's flattened bucket: ``{"flattened_tensor": uint8, "metadata": [SimpleNamespace]}`` (aligned).

    One allocation, each tensor copied into its slice once, strided views included: a weight sync of an 8B model
    moves 16 GB, and a ``contiguous()`` of a view then a ``cat`` would copy each byte twice more."""
    if not named_tensors:
        raise ValueError("named_tensors (empty) must hold at least one tensor because SGLang rejects empty buckets")
    metadata, offset = [], 0
    for name, tensor in named_tensors:
        offset += -offset % ALIGN_BYTES
        nbytes = tensor.numel() * tensor.element_size()
        metadata.append(
            types.SimpleNamespace(
                name=name,
                shape=tensor.shape,
                dtype=tensor.dtype,
                start_idx=offset,
                end_idx=offset + nbytes,
                numel=nbytes,
            )
        )
        offset += nbytes
    flat = torch.empty(offset, dtype=torch.uint8, device=named_tensors[0][1].device)
    slots, end = [], 0
    for meta, (_, tensor) in zip(metadata, named_tensors, strict=True):
        if meta.start_idx > end:
            flat[end : meta.start_idx].zero_()  # alignment padding: deterministic bytes
        slots.append(flat[meta.start_idx : meta.end_idx].view(tensor.dtype).view(tensor.shape))
        end = meta.end_idx
    torch._foreach_copy_(slots, [tensor.detach() for _, tensor in named_tensors])
    return {"flattened_tensor": flat, "metadata": metadata}


def deserialize_flattened_bucket(payload: bytes) -> NamedTensors:
    """Unpickle a payload with SGLang's allowlist and cut it back into ``(name, tensor)`` views.

    The views share the received flat buffer; copy them into their destination before dropping it.
    """
    bucket = _SafeUnpickler(io.BytesIO(payload)).load()
    if not isinstance(bucket, dict) or set(bucket) != {"flattened_tensor", "metadata"}:
        keys = sorted(bucket) if isinstance(bucket, dict) else type(bucket).__name__
        raise ValueError(
            f"payload ({keys}) must be a dict with keys flattened_tensor and metadata "
            "because that is SGLang's flattened_bucket format; build it with serialize_flattened_bucket"
        )
    flat = bucket["flattened_tensor"]
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"flattened_tensor ({flat.dtype}, {flat.dim()}-d) must be a 1-d uint8 tensor")
    named = []
    for meta in bucket["metadata"]:
        if meta.start_idx % meta.dtype.itemsize:
            raise ValueError(
                f"tensor {meta.name} offset ({meta.start_idx}) must be a multiple of its element size "
                f"({meta.dtype.itemsize}) because it is viewed in place; pad the bucket as "
                "serialize_flattened_bucket does"
            )
        named.append((meta.name, flat[meta.start_idx : meta.end_idx].view(meta.dtype).reshape(meta.shape)))
    return named


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[NamedTensors]:
    """Group tensors, in order, into lists of at most ``bucket_bytes`` bytes each.

    A tensor larger than ``bucket_bytes`` travels alone in its own bucket rather than failing:
    the limit bounds the extra memory of the flat copy, and one oversized tensor needs it anyway.
    """
    if bucket_bytes < 1:
        raise ValueError(
            f"bucket_bytes ({bucket_bytes}) must be >= 1 because buckets hold whole tensors; "
            "set engine.bucket_bytes to a positive size such as 512 MiB"
        )
    bucket: NamedTensors = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def tensor_checksum(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (in its own dtype), for verifying that a sync landed exactly."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()
