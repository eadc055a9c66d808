"""hybridflow.data: prompt datasets in veRL's schema, the resumable prompt loader, built-in tasks."""

from hybridflow.data.dataset import RLDataset
from hybridflow.data.loader import RLDataLoader, collate_prompts
from hybridflow.data.schema import DataConfigError

__all__ = ["DataConfigError", "RLDataLoader", "RLDataset", "collate_prompts"]
