"""The library-noise filter drops exactly the messages it lists (issue 39: vLLM's "raw prompts to
InputProcessor is deprecated" warning, which every multi-turn run printed), and nothing else on that logger."""

import logging

import pytest

from hflow.utils import logging_utils


@pytest.fixture
def captured(monkeypatch):
    monkeypatch.delenv(logging_utils.SHOW_ENV, raising=False)
    monkeypatch.setattr(logging_utils, "_installed", False)
    before = {name: list(logging.getLogger(name).filters) for name in logging_utils.LIBRARY_NOISE}
    logging_utils.install_library_filter()
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logger = logging.getLogger("vllm.v1.engine.input_processor")
    handler = Keep()
    logger.addHandler(handler)
    yield logger, records
    logger.removeHandler(handler)
    for name, kept in before.items():  # only this test's filters: the session's own stay installed
        for f in list(logging.getLogger(name).filters):
            if f not in kept:
                logging.getLogger(name).removeFilter(f)


def test_the_input_processor_deprecation_is_dropped_and_other_warnings_stay(captured):
    logger, records = captured
    logger.warning("Passing raw prompts to InputProcessor is deprecated and will be removed in the future.")
    logger.warning("Prompt length 9000 exceeds the model's context")  # about the user's input: shown
    assert records == ["Prompt length 9000 exceeds the model's context"]
