"""``augment.decode: device``: train JPEGs decoded on the training device, a parcel at a time.

Loader workers then only read: they ship each parcel's JPEG bytes as one uint8 tensor, with each
sample's length and crop seed, and the device decodes them in one batched call
(``torchvision.io.decode_jpeg(list, device=...)``: nvJPEG on CUDA, libjpeg-turbo on a CPU) and crops,
resizes and flips each image there with :meth:`.SampleTransform.apply` and the seed the loader
workers would have used: the same crop region and flip as ``decode: loader`` for any world size.
"""
from __future__ import annotations

import torch
from torchvision.io import ImageReadMode, decode_jpeg

from .draft import JPEG_EXTS
from .integrity import bad_sample
from .transforms import SampleTransform


def encode_parcel(samples: list[dict], seeds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(all JPEG bytes, concatenated, uint8 [total]; int64 [N, 2] of each one's length and crop seed)."""
    parts = []
    for sample in samples:
        ext = next((e for e in JPEG_EXTS if e in sample), None)
        if ext is None:
            found = sorted(k for k in sample if k[:2] != "__")
            raise bad_sample(sample, f"augment.decode: device decodes JPEGs only, its fields are {found}; "
                                     f"set augment.decode: loader")
        parts.append(sample[ext])
    data = torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)
    return data, torch.tensor([[len(p), seed] for p, seed in zip(parts, seeds)], dtype=torch.int64)


def decode_parcel(data: torch.Tensor, encoded: torch.Tensor, transform: SampleTransform,
                  device: torch.device) -> torch.Tensor:
    """:func:`encode_parcel`'s tensors (on the host) -> uint8 [N, 3, size, size] on ``device``, cropped and
    flipped as ``transform`` does each sample with its seed."""
    lengths, seeds = encoded[:, 0].tolist(), encoded[:, 1].tolist()
    try:
        images = decode_jpeg(list(torch.split(data.cpu(), lengths)), mode=ImageReadMode.RGB, device=device)
    except RuntimeError as exc:
        raise ValueError(f"augment.decode: device: a JPEG of this batch does not decode on {device} "
                         f"({' '.join(str(exc).split())[:200]}); set augment.decode: loader to find which "
                         f"(each sample decoded on its own, named when bad)") from None
    return torch.stack([transform.apply(img, seed) for img, seed in zip(images, seeds)])
