"""The workers' tiny model and one-rank world, for the judge worker's tests."""

from tests.workers.conftest import tiny_model_dir, tiny_tokenizer, world  # noqa: F401
