"""The Tandem API (group tandem.dev, version v1alpha1): one typed definition, the CRDs generated from it."""

from tandem.api.common import API_VERSION, GROUP, VERSION, Condition, ObjectMeta
from tandem.api.inference import InferencePool, InferencePoolSpec, InferencePoolStatus, ModelSource
from tandem.api.training import (
    ParallelTrainingJob,
    ParallelTrainingJobSpec,
    ParallelTrainingJobStatus,
    TrainerSpec,
)

KINDS = {"ParallelTrainingJob": ParallelTrainingJob, "InferencePool": InferencePool}

__all__ = [
    "API_VERSION",
    "GROUP",
    "KINDS",
    "VERSION",
    "Condition",
    "InferencePool",
    "InferencePoolSpec",
    "InferencePoolStatus",
    "ModelSource",
    "ObjectMeta",
    "ParallelTrainingJob",
    "ParallelTrainingJobSpec",
    "ParallelTrainingJobStatus",
    "TrainerSpec",
]
