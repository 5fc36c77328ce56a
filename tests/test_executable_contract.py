"""The backend contract: every backend module is a `Backend`, every executable an `Executable`
holding its caches and the limits they set, with the optional capabilities declared."""

from __future__ import annotations

import pytest
import torch

from kiln.backends.executable import Backend, BackendOptions, Executable, capabilities
from kiln.backends.reference import ReferenceExecutable
from kiln.backends.registry import BACKEND_MEMBERS, BACKENDS, get_backend
from test_generate_loop import MAX_SEQ_LEN, tiny_stateful_graph


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_backend_module_provides_what_backend_declares(name):
    module = get_backend(name)
    assert module.NAME == name and isinstance(module.backend_version(), str)
    assert set(BACKEND_MEMBERS) == {"NAME"} | {m for m in vars(Backend) if not m.startswith("_")}


def test_every_executable_class_is_an_executable():
    from kiln.backends.inductor import AOTIExecutable, InductorExecutable
    from kiln.backends.onnxruntime import OrtExecutable
    from kiln.backends.onnxruntime.executable import OrtModelForAnotherMachine
    from kiln.backends.tinygrad import TinygradExecutable

    for cls in (
        ReferenceExecutable,
        InductorExecutable,
        AOTIExecutable,
        OrtExecutable,
        OrtModelForAnotherMachine,
        TinygradExecutable,
    ):
        assert issubclass(cls, Executable), cls


def test_the_limits_come_from_the_caches_at_most_what_the_options_ask():
    executable = ReferenceExecutable(
        tiny_stateful_graph(0, max_batch=3), BackendOptions(max_batch=2, max_seq_len=MAX_SEQ_LEN * 2)
    )
    assert (executable.max_batch, executable.max_seq_len) == (2, MAX_SEQ_LEN)
    assert [tuple(c.shape[::2]) for c in executable.caches] == [(3, MAX_SEQ_LEN)] * 2
    executable.caches[0].fill_(1.0)
    views = executable.cache_views()
    executable.reset()
    assert all(not view.any() for view in views)  # zeroed in place: views stay the buffers


def test_optional_capabilities_have_declared_defaults_and_stand_ins_may_set_them():
    executable = ReferenceExecutable(tiny_stateful_graph(), BackendOptions(max_batch=2, max_seq_len=MAX_SEQ_LEN))
    declared = capabilities(executable)
    assert (declared.selects_logits, declared.copies_rows) == (False, True)
    assert declared.logits_buffer(2, 1) is None

    class StandIn:  # only run and cache_views, as a test's wrapper has
        copies_rows = False

        def run(self, tokens, positions, first_row=0):
            return torch.zeros(1)

    stand_in = capabilities(StandIn())
    assert (stand_in.selects_logits, stand_in.copies_rows, stand_in.logits_buffer(1, 1)) == (False, False, None)
