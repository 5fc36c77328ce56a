"""The artifact directory: a round trip, and a clear ArtifactError for each way it can be wrong."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import save_file

import kiln
from kiln.backends.executable import BackendOptions
from kiln.backends.reference import ReferenceExecutable
from kiln.cli import kiln_main
from kiln.ir import Graph, TensorType, print_graph, symbol
from kiln.runtime.artifact import FORMAT_VERSION, read_artifact, save_artifact, sealed
from kiln.runtime.errors import ArtifactError
from kiln.runtime.generate import LLM
from kiln.runtime.tokenizer import Tokenizer
from tiny_models import VOCAB_SIZE, tokenizer_config, tokenizer_json

OPTIONS = BackendOptions(max_batch=1, max_seq_len=16)


def tiny_graph() -> Graph:
    """tokens -> embedding -> tied linear -> logits: the smallest graph the runtime can run."""
    g = Graph()
    g.add_symbol("batch", 1, 1)
    g.add_symbol("seq", 1, 16)
    tokens = g.add_input("tokens", TensorType("i64", (symbol("batch"), symbol("seq"))))
    g.add_input("positions", TensorType("i64", (symbol("batch"), symbol("seq"))))
    embed = g.add_param("embed", torch.randn(VOCAB_SIZE, 8, generator=torch.Generator().manual_seed(0)))
    g.outputs = [g.call("linear", g.call("embedding", embed, tokens), embed, name="logits")]
    return g


@pytest.fixture
def tokenizer_dir(tmp_path):
    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "tokenizer.json").write_text(tokenizer_json())
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config()))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    return directory


@pytest.fixture
def artifact(tmp_path, tokenizer_dir):
    graph = tiny_graph()
    fields = {
        "backend": "reference",
        "backend_version": torch.__version__,
        "source_hash": "0" * 64,
        "options": {"max_batch": 1, "max_seq_len": 16, "dtype": "f32", "quantize": None},
    }
    return save_artifact(tmp_path / "model.kiln", graph, ReferenceExecutable(graph, OPTIONS), tokenizer_dir, fields)


def manifest(artifact) -> dict:
    return json.loads((artifact / "manifest.json").read_text())


def replace_file(artifact, name: str, data: bytes) -> None:
    """Change a file and update (and reseal) the manifest to match, so only the content itself is wrong."""
    (artifact / name).write_bytes(data)
    m = manifest(artifact)
    m["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    if name == "graph.kir":
        m["ir_hash"] = hashlib.sha256(data).hexdigest()
    (artifact / "manifest.json").write_text(json.dumps(sealed(m)))


def edit_manifest(artifact, **changes) -> None:
    """Change manifest fields and reseal it (fields_sha256), as a deliberate rewrite would."""
    (artifact / "manifest.json").write_text(json.dumps(sealed({**manifest(artifact), **changes})))


def test_round_trip_keeps_graph_weights_and_manifest(artifact):
    contents = read_artifact(artifact)
    assert print_graph(contents.graph) == print_graph(tiny_graph())
    torch.testing.assert_close(contents.graph.weights["embed"], tiny_graph().weights["embed"])
    m = contents.manifest
    assert (m["format"], m["format_version"], m["backend"]) == ("kiln-artifact", FORMAT_VERSION, "reference")
    assert m["ir_hash"] == hashlib.sha256((artifact / "graph.kir").read_bytes()).hexdigest()
    assert set(m["files"]) == {
        "graph.kir",
        "weights.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    }


def test_loaded_artifact_generates_like_the_graph_it_came_from(artifact, tokenizer_dir):
    llm = kiln.load(artifact)
    expected = LLM(ReferenceExecutable(tiny_graph(), OPTIONS), Tokenizer.from_dir(tokenizer_dir))
    assert (
        llm.generate("Once upon", max_new_tokens=4).token_ids
        == expected.generate("Once upon", max_new_tokens=4).token_ids
    )


def test_saving_replaces_an_artifact_but_refuses_other_directories(artifact, tmp_path):
    graph = tiny_graph()
    save_artifact(artifact, graph, ReferenceExecutable(graph, OPTIONS), None, {"backend": "reference", "options": {}})
    assert "tokenizer.json" not in manifest(artifact)["files"] and not (artifact / "tokenizer.json").exists()
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    with pytest.raises(ArtifactError, match="refusing to overwrite"):
        save_artifact(tmp_path / "precious", graph, ReferenceExecutable(graph, OPTIONS), None, {})


def test_tied_weights_sharing_storage_are_saved(tmp_path):
    graph = tiny_graph()
    graph.add_param("embed_copy", graph.weights["embed"])
    save_artifact(
        tmp_path / "a", graph, ReferenceExecutable(graph, OPTIONS), None, {"backend": "reference", "options": {}}
    )
    assert set(read_artifact(tmp_path / "a").graph.weights) == {"embed", "embed_copy"}


def test_missing_directory(tmp_path):
    with pytest.raises(ArtifactError, match="does not exist"):
        read_artifact(tmp_path / "nowhere")


def test_missing_manifest(tmp_path):
    with pytest.raises(ArtifactError, match="manifest.json is missing"):
        read_artifact(tmp_path)


def test_manifest_that_is_not_json(artifact):
    (artifact / "manifest.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="manifest.json is not valid JSON"):
        read_artifact(artifact)


def test_foreign_format(artifact):
    edit_manifest(artifact, format="onnx-model")
    with pytest.raises(ArtifactError, match="foreign format.*onnx-model"):
        read_artifact(artifact)


def test_newer_format_version(artifact):
    edit_manifest(artifact, format_version=FORMAT_VERSION + 1)
    with pytest.raises(ArtifactError, match="newer than this Kiln supports.*upgrade Kiln"):
        read_artifact(artifact)


def test_missing_listed_file(artifact):
    (artifact / "tokenizer.json").unlink()
    with pytest.raises(ArtifactError, match="tokenizer.json is missing"):
        read_artifact(artifact)


def test_truncated_file(artifact):
    data = (artifact / "weights.safetensors").read_bytes()
    (artifact / "weights.safetensors").write_bytes(data[:-100])
    with pytest.raises(ArtifactError, match="weights.safetensors has .* bytes but the manifest says .*truncated"):
        read_artifact(artifact)


def test_damaged_file(artifact):
    data = bytearray((artifact / "weights.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (artifact / "weights.safetensors").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="weights.safetensors does not match its sha256.*damaged"):
        read_artifact(artifact)
    deferred = read_artifact(artifact, defer_weights_hash=True)  # hashed on a thread meanwhile
    with pytest.raises(ArtifactError, match="weights.safetensors does not match its sha256.*damaged"):
        deferred.finish_checks()
    with pytest.raises(ArtifactError, match="weights.safetensors does not match its sha256.*damaged"):
        kiln.load(artifact)


def test_graph_that_does_not_parse(artifact):
    replace_file(artifact, "graph.kir", b"kir 1\nthis is not IR\n")
    with pytest.raises(ArtifactError, match="graph.kir does not parse"):
        read_artifact(artifact)


def test_graph_that_does_not_verify(artifact):
    text = (artifact / "graph.kir").read_text().replace("= linear(", "= matmul(")
    replace_file(artifact, "graph.kir", text.encode())
    with pytest.raises(ArtifactError, match="graph.kir parses but does not verify"):
        read_artifact(artifact)


def test_weights_missing_a_parameter(artifact, tmp_path):
    save_file({"other": torch.zeros(2)}, str(tmp_path / "w.safetensors"))
    replace_file(artifact, "weights.safetensors", (tmp_path / "w.safetensors").read_bytes())
    with pytest.raises(
        ArtifactError, match=r"weights.safetensors does not match graph.kir's parameters \(missing \['embed'\]"
    ):
        read_artifact(artifact)


def test_weight_with_the_wrong_shape(artifact, tmp_path):
    save_file({"embed": torch.zeros(VOCAB_SIZE, 4)}, str(tmp_path / "w.safetensors"))
    replace_file(artifact, "weights.safetensors", (tmp_path / "w.safetensors").read_bytes())
    with pytest.raises(ArtifactError, match="weight embed is .* but graph.kir declares f32\\[512, 8\\]"):
        read_artifact(artifact)


def test_file_listed_outside_the_artifact_is_refused(artifact):
    m = manifest(artifact)
    m["files"]["../secret"] = {"sha256": "0", "bytes": 1}
    (artifact / "manifest.json").write_text(json.dumps(sealed(m)))
    with pytest.raises(ArtifactError, match="outside the artifact"):
        read_artifact(artifact)


def test_cli_generates_from_an_artifact(artifact, capsys):
    assert kiln_main(["generate", str(artifact), "--prompt", "Once upon", "--max-new-tokens", "3"]) == 0
    out, err = capsys.readouterr()
    assert out.endswith("\n") and "3 new tokens" in err and "tok/s" in err


def test_cli_reports_a_kiln_error_in_one_line_with_exit_status_2(tmp_path, capsys):
    assert kiln_main(["generate", str(tmp_path / "missing.kiln"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: Artifact directory") and err.count("\n") == 1 and "Traceback" not in err


def test_load_names_an_unknown_backend(artifact):
    edit_manifest(artifact, backend="abacus")
    with pytest.raises(kiln.BackendNotFoundError, match="Unknown backend 'abacus'"):
        kiln.load(artifact)


def test_a_dtype_the_target_cannot_run_is_refused_before_any_work(tmp_path):
    """The manifest records the dtype, so an unsupported one is an error, not silently f32."""
    with pytest.raises(ValueError, match=r"dtype 'i8' is not one Kiln compiles.*Fix: use one of"):
        kiln.compile(str(tmp_path / "missing-model"), out=tmp_path / "m.kiln", dtype="i8")
    with pytest.raises(ValueError, match=r"dtype 'f16' is for GPUs.*device='cpu'.*Fix: dtype='f32'"):
        kiln.compile(str(tmp_path / "missing-model"), out=tmp_path / "m.kiln", dtype="f16", backend="onnxruntime")
    with pytest.raises(ValueError, match=r"dtype 'bf16' is for GPUs.*device='cpu'.*Fix: dtype='f32'"):
        kiln.compile(str(tmp_path / "missing-model"), out=tmp_path / "m.kiln", dtype="bf16")
    with pytest.raises(ValueError, match=r"dtype 'bf16' is not supported by the onnxruntime backend.*dtype='f16'"):
        kiln.compile(
            str(tmp_path / "missing-model"), out=tmp_path / "m.kiln", dtype="bf16", device="cuda", backend="onnxruntime"
        )
    with pytest.raises(ValueError, match=r"device 'cuda': the reference backend runs on the CPU only"):
        kiln.compile(str(tmp_path / "missing-model"), out=tmp_path / "m.kiln", device="cuda", backend="reference")
    with pytest.raises(ValueError, match=r"quantize='int8' with dtype 'f16' is not supported yet"):
        kiln.compile(
            str(tmp_path / "missing-model"),
            out=tmp_path / "m.kiln",
            dtype="f16",
            device="cuda",
            backend="onnxruntime",
            quantize="int8",
        )


# -- the manifest's own integrity, and pinning an artifact ----------------------------------------
@pytest.mark.parametrize("option, value", [("max_seq_len", 4096), ("threads", -5)])
def test_an_edited_manifest_option_is_refused_naming_the_manifest(artifact, option, value):
    m = manifest(artifact)
    m["options"][option] = value  # edited by hand: fields_sha256 left as it was
    (artifact / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ArtifactError, match=r"manifest.json was edited after compiling.*max_seq_len and threads"):
        read_artifact(artifact)


def test_an_artifact_pinned_by_its_manifest_sha256_loads_and_any_other_is_refused(artifact, tmp_path):
    from kiln.runtime.artifact import manifest_sha256

    pin = manifest_sha256(artifact)
    assert pin == hashlib.sha256((artifact / "manifest.json").read_bytes()).hexdigest()
    assert read_artifact(artifact, expected_sha256=pin.upper()).manifest == manifest(artifact)
    edit_manifest(artifact, source="elsewhere")  # a resealed manifest: consistent, but not the one pinned
    with pytest.raises(ArtifactError, match=r"manifest.json has sha256 [0-9a-f]{64}, not the expected " + pin):
        read_artifact(artifact, expected_sha256=pin)
    with pytest.raises(ArtifactError, match="is not a sha256"):
        read_artifact(artifact, expected_sha256="abc")
    with pytest.raises(ArtifactError, match="leave check_hashes on"):
        read_artifact(artifact, check_hashes=False, expected_sha256=pin)


def test_kiln_load_refuses_an_artifact_other_than_the_pinned_one_before_loading_its_code(artifact, monkeypatch):
    from kiln.runtime.artifact import manifest_sha256

    pin = manifest_sha256(artifact)
    assert kiln.load(artifact, expected_sha256=pin).generate([3, 4], max_new_tokens=2).token_ids
    edit_manifest(artifact, source="a rebuilt artifact")
    monkeypatch.setattr("kiln.api.get_backend", lambda name: pytest.fail("the backend was reached"))
    with pytest.raises(ArtifactError, match=f"not the expected {pin}"):
        kiln.load(artifact, expected_sha256=pin)


def test_cli_expect_sha256_pins_the_artifact_for_generate_and_serve(artifact, capsys):
    from kiln.runtime.artifact import manifest_sha256

    pin = manifest_sha256(artifact)
    assert (
        kiln_main(["generate", str(artifact), "--prompt", "Once", "--max-new-tokens", "2", "--expect-sha256", pin]) == 0
    )
    capsys.readouterr()
    for command in (["generate", str(artifact), "--prompt", "Once"], ["serve", str(artifact)]):
        assert kiln_main([*command, "--expect-sha256", "0" * 64]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and f"not the expected {'0' * 64}" in err


@pytest.mark.parametrize(
    "option, value", [("threads", -5), ("max_batch", 0), ("max_seq_len", "1024"), ("quantize_embeddings", "yes")]
)
def test_options_no_backend_can_run_with_are_refused_even_in_a_resealed_manifest(artifact, option, value):
    import dataclasses

    from kiln.api import OPTION_CHECKS
    from kiln.backends.executable import BackendOptions

    assert set(OPTION_CHECKS) == {field.name for field in dataclasses.fields(BackendOptions)}
    m = manifest(artifact)
    edit_manifest(artifact, options={**m["options"], option: value})
    with pytest.raises(ArtifactError, match=f"manifest.json gives {option}=.*which no backend can run.*Fix: recompile"):
        kiln.load(artifact)


def saved_as_older(tmp_path, tokenizer_dir, graph, new_text: str, old_text: str):
    """`graph` saved as a reference artifact whose graph.kir then reads as an older Kiln wrote it
    (`new_text` replaced by `old_text`)."""
    fields = {
        "backend": "reference",
        "backend_version": torch.__version__,
        "source_hash": "0" * 64,
        "options": {"max_batch": 1, "max_seq_len": 16, "dtype": "f32", "quantize": None},
    }
    path = save_artifact(tmp_path / "m.kiln", graph, ReferenceExecutable(graph, OPTIONS), tokenizer_dir, fields)
    text = (path / "graph.kir").read_text()
    older = text.replace(new_text, old_text)
    assert older != text
    replace_file(path, "graph.kir", older.encode())
    return path


def test_an_artifact_compiled_before_an_op_gained_an_attribute_loads_with_its_default(tmp_path, tokenizer_dir):
    """An older graph.kir lacks attributes its ops have since gained (attention's alibi): read
    with their defaults, which keep the op's earlier meaning. Here `mean`'s keepdim stands in."""
    graph = tiny_graph()
    bias = graph.call("mean", graph.params["embed"], axes=(1,), keepdim=False)  # [vocab]
    graph.outputs = [graph.call("add", graph.outputs[0], bias, name="biased_logits")]
    path = saved_as_older(tmp_path, tokenizer_dir, graph, ", keepdim=false", "")
    node = next(n for n in read_artifact(path).graph.nodes if n.op == "mean")
    assert node.attrs["keepdim"] is False


def test_an_artifact_compiled_before_an_op_gained_an_optional_input_loads(tmp_path, tokenizer_dir):
    """An older graph.kir names fewer inputs than its ops now take (attention before its token
    tree): the missing trailing optional inputs read as omitted. Here `linear`'s bias stands in."""
    graph = tiny_graph()
    path = saved_as_older(tmp_path, tokenizer_dir, graph, "linear(%0, %embed, _)", "linear(%0, %embed)")
    node = next(n for n in read_artifact(path).graph.nodes if n.op == "linear")
    assert len(node.inputs) == 3 and node.inputs[2] is None


def test_an_attribute_the_op_does_not_have_is_an_artifact_error(artifact):
    lines = (artifact / "graph.kir").read_text().splitlines()
    index = next(i for i, line in enumerate(lines) if "= linear(" in line)
    lines[index] += " {bogus=1}"
    replace_file(artifact, "graph.kir", ("\n".join(lines) + "\n").encode())
    with pytest.raises(ArtifactError, match="graph.kir.*bogus"):
        read_artifact(artifact)
