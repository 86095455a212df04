"""The codec registry: one class per codec, looked up by the name a manifest records.

A codec says how a feature's logical values (what a trainer sees: bf16, float32, int32) become the
bits a store keeps (bf16 and float8 have no Zarr or Arrow dtype, so their bit patterns are stored as
uint16/uint8), which extra arrays it needs (fp8's per-row scales), and how to go back, to numpy
(no torch needed) or to torch on any device. Adding a codec is one subclass of
:class:`FeatureCodec` decorated with :func:`register_codec`; feature specs, the writer, the readers,
verify and info all go through :func:`codec_for`.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

import numpy as np

from hsstore.errors import CodecError

if TYPE_CHECKING:
    import torch


class FeatureSpec(Protocol):
    """What a codec reads of a :class:`hsstore.format.features.FeatureSpec` (which imports this
    module, so it is not imported back)."""

    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


def is_torch(value: Any) -> bool:
    """Whether ``value`` is a torch tensor, without importing torch."""
    return type(value).__module__.startswith("torch")


class FeatureCodec(abc.ABC):
    """How one codec stores values. Subclasses set the three names and implement the four abstract
    methods (a codec missing one cannot be instantiated, so it fails when registered).

    ``raw`` arguments map array names (``spec.name``, plus each extra array's name) to stored bits:
    numpy arrays, or torch tensors already on the decode device.
    """

    name: ClassVar[str]
    storage_dtype: ClassVar[str]  # numpy dtype of the stored bits
    logical_dtype: ClassVar[str]  # torch dtype decoding gives (numpy decoding: float32 for floats)

    def extra_arrays(self, spec: FeatureSpec) -> list[tuple[str, tuple[int, ...], str]]:
        """``(array name, per-token shape, stored dtype)`` of the arrays this codec adds."""
        return []

    @abc.abstractmethod
    def encode_numpy(self, spec: FeatureSpec, values: np.ndarray) -> dict[str, np.ndarray]:
        """Encode on the host: the stored arrays, by name."""

    @abc.abstractmethod
    def encode_torch(self, spec: FeatureSpec, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """Encode on ``tensor``'s device, without a sync: the stored arrays as tensors there (bits
        whose numpy dtype torch lacks come back reinterpreted, e.g. bf16's uint16 as int16). What
        the device cannot refuse without a sync is flagged for :meth:`check_encoded` instead."""

    def check_encoded(self, spec: FeatureSpec, encoded: dict[str, np.ndarray]) -> None:
        """Raise :class:`CodecError` for what :meth:`encode_torch` could only flag (on the host)."""
        return  # by default nothing: a codec whose device encoding refuses nothing has nothing to flag

    @abc.abstractmethod
    def decode_numpy(self, spec: FeatureSpec, raw: dict[str, Any], name: str) -> np.ndarray:
        """Decode ``raw[name]`` on the host (floats as float32: numpy has no bf16)."""

    @abc.abstractmethod
    def decode_torch(
        self,
        spec: FeatureSpec,
        raw: dict[str, Any],
        name: str,
        bits_t: torch.Tensor,
        *,
        device: Any,
        out: torch.Tensor | None,
        threads: int | None,
    ) -> torch.Tensor:
        """Decode ``bits_t`` (``raw[name]`` as a tensor on the decode device). May write into
        ``out`` (already checked) and return it; the caller copies into ``out`` otherwise."""


_CODECS: dict[str, FeatureCodec] = {}
CodecClass = TypeVar("CodecClass", bound=type[FeatureCodec])


def register_codec(cls: CodecClass) -> CodecClass:
    """Class decorator: make ``cls`` the codec named ``cls.name``."""
    if cls.name in _CODECS and type(_CODECS[cls.name]) is not cls:
        raise CodecError(f"codec {cls.name!r} is registered twice ({type(_CODECS[cls.name]).__name__}, {cls.__name__})")
    _CODECS[cls.name] = cls()
    return cls


def codec_for(name: str) -> FeatureCodec:
    """The registered codec ``name``; :class:`CodecError` naming the known ones otherwise."""
    try:
        return _CODECS[name]
    except KeyError:
        raise CodecError(f"unknown codec {name!r}; known codecs: {', '.join(codec_names())}") from None


def codec_names() -> list[str]:
    return sorted(_CODECS)
