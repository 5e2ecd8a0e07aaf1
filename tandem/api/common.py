"""Building blocks shared by both resources: the base model, pod passthrough fields, conditions."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator
from pydantic.alias_generators import to_camel

GROUP = "tandem.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

CALLABLE_REF = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_.]*$"
CallableRef = Annotated[str, StringConstraints(pattern=CALLABLE_REF)]
"""A `module.path:attribute` reference to Python code importable in the worker image."""

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
ResourceName = Annotated[str, StringConstraints(min_length=1, max_length=63, pattern=DNS_LABEL)]
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SubdomainName = Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)]
Quantity = int | str
"""A Kubernetes quantity: an integer or a string such as `500m`, `4Gi`, `1`."""

_QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")


def valid_quantity(quantity: Quantity) -> Quantity:
    if isinstance(quantity, str) and not _QUANTITY.match(quantity):
        raise ValueError(f"{quantity!r} is not a Kubernetes quantity (e.g. 2, 500m, 4Gi)")
    return quantity


class ApiModel(BaseModel):
    """Base for every API object: camelCase on the wire, unknown fields rejected."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        validate_default=True,
    )

    def to_dict(self) -> dict[str, Any]:
        """The wire form: camelCase keys, JSON types, unset optional fields left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class ObjectMeta(ApiModel):
    """The parts of Kubernetes object metadata Tandem reads; other keys pass through."""

    model_config = ConfigDict(extra="allow")

    name: Annotated[str, StringConstraints(min_length=1, max_length=63, pattern=DNS_LABEL)]
    """Resource name: lowercase letters, digits and '-', starting and ending alphanumeric."""
    namespace: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class ResourceRequirements(ApiModel):
    """Container resources, as in a Pod spec (`cpu`, `memory`, `nvidia.com/gpu`, ...)."""

    limits: dict[str, Quantity] = Field(default_factory=dict)
    requests: dict[str, Quantity] = Field(default_factory=dict)

    @field_validator("limits", "requests")
    @classmethod
    def _quantities(cls, value: dict[str, Quantity]) -> dict[str, Quantity]:
        for name, quantity in value.items():
            try:
                valid_quantity(quantity)
            except ValueError as error:
                raise ValueError(f"{name}: {error}") from None
        return value


class EnvVar(ApiModel):
    """An environment variable for the containers, as in a Pod spec."""

    name: Annotated[str, StringConstraints(min_length=1)]
    value: str | None = None
    value_from: dict[str, Any] | None = None
    """A Pod-spec `valueFrom` source (secretKeyRef, configMapKeyRef, fieldRef, ...)."""


class Toleration(ApiModel):
    """A Pod toleration, passed through to the pods."""

    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class Volume(ApiModel):
    """A Pod volume (any Pod-spec volume source), passed through to the pods."""

    model_config = ConfigDict(extra="allow")

    name: ResourceName


class VolumeMount(ApiModel):
    """A volume mount for the containers, as in a Pod spec."""

    name: ResourceName
    mount_path: Annotated[str, StringConstraints(min_length=1, pattern=r"^/")]
    read_only: bool = False
    sub_path: str | None = None


class PodSettings(ApiModel):
    """What every pod the operator creates passes through to Kubernetes."""

    image: str | None = None
    """Container image with tandem and the user's code; defaults to the operator's worker image."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)
    env: list[EnvVar] = Field(default_factory=list)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    volumes: list[Volume] = Field(default_factory=list)
    volume_mounts: list[VolumeMount] = Field(default_factory=list)
    scheduler_name: SubdomainName | None = None
    """The pods' scheduler: a batch scheduler (Volcano, Kueue's, ...) can admit a job's ranks as one gang."""
    priority_class_name: SubdomainName | None = None
    """The pods' PriorityClass, for preemption between jobs."""


class Condition(ApiModel):
    """A Kubernetes-style condition: the latest observation of one aspect of the resource."""

    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: datetime | None = None
