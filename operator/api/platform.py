"""What the operator's own configuration adds to every InferenceService it serves.

``Platform.default_image`` is the engine image pods run when ``spec.image`` is unset (``kvpilot
operator --default-image``, the chart's ``engine.defaultImage``; by default the engine image built for
this version); ``default_vllm_image`` is the same for ``spec.runtime: vllm`` (``--default-vllm-image``;
by default the vLLM release the operator is tested against); ``router_image`` is what
``spec.router.frontDoor`` pods run when it names no image (``--router-image``; the chart passes the
operator's own image). ``allowed_registries`` /
``allowed_service_accounts`` are optional allowlists: creating an InferenceService lets its author run
pods with an image and a service account of their choosing, as a Deployment would, and a platform team
may narrow that. An object outside them gets ``SpecValid=False``
with the reason, and nothing is rendered.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from kvpilot import __version__

DEFAULT_ENGINE_IMAGE = f"ghcr.io/kvpilot/engine:{__version__}"
# The upstream vLLM release the ``runtime: vllm`` path is tested against (its OpenAI server image).
DEFAULT_VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"
# The image ``spec.router.frontDoor`` pods run ``kvpilot router`` from when it sets none: the operator's
# own (slim, and it carries the kvpilot command).
DEFAULT_ROUTER_IMAGE = f"ghcr.io/kvpilot/operator:{__version__}"


def image_registry(image: str) -> str:
    """The registry host of an image reference (``docker.io`` when it names none, as Docker reads it)."""
    first, sep, _ = image.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return first
    return "docker.io"


@dataclasses.dataclass(frozen=True)
class Platform:
    """The operator-level settings every InferenceService is resolved with (see the module doc).
    Empty allowlists allow everything."""

    default_image: str = DEFAULT_ENGINE_IMAGE
    allowed_registries: tuple[str, ...] = ()
    allowed_service_accounts: tuple[str, ...] = ()
    default_vllm_image: str = DEFAULT_VLLM_IMAGE
    router_image: str = DEFAULT_ROUTER_IMAGE

    def __post_init__(self) -> None:
        if not self.default_image:
            raise ValueError("the default engine image must not be empty")
        if not self.default_vllm_image:
            raise ValueError("the default vLLM image must not be empty")
        if not self.router_image:
            raise ValueError("the router image must not be empty")

    def image_for(self, runtime: str) -> str:
        """The image pods of ``runtime`` (``kvpilot`` | ``vllm``) run when ``spec.image`` is unset."""
        return self.default_vllm_image if runtime == "vllm" else self.default_image

    def problems(self, spec: Mapping[str, Any]) -> list[str]:
        """Why ``spec`` (defaults applied, image filled in) is outside the allowlists; empty: inside."""
        out = []
        image = str(spec.get("image") or "")
        registry = image_registry(image)
        if self.allowed_registries and registry not in self.allowed_registries:
            out.append(
                f"spec.image {image!r}: registry {registry} is not allowed by the operator "
                f"(allowed: {', '.join(self.allowed_registries)})"
            )
        account = ((spec.get("pod") or {}).get("serviceAccountName")) or "default"
        if self.allowed_service_accounts and account not in self.allowed_service_accounts:
            out.append(
                f"spec.pod.serviceAccountName {account!r} is not allowed by the operator "
                f"(allowed: {', '.join(self.allowed_service_accounts)})"
            )
        return out


def split_list(value: str | Iterable[str] | None) -> tuple[str, ...]:
    """A comma-separated flag or env value (or a list) as a tuple, blanks dropped."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else value
    return tuple(item.strip() for item in items if item and item.strip())


DEFAULT_PLATFORM = Platform()
