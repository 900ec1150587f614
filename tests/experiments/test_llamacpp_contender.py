"""experiments.llamacpp_contender: the F32 GGUF holds the source's metadata and exactly its
dequantized tensors; the backend counts llama-server's streamed token ids and drops (never
raises) a cut stream; serve_load reports a missing binary as a skip."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from experiments import llamacpp_contender as lc
from experiments import serve_load as sl

gguf = pytest.importorskip("gguf")
pytest.importorskip("httpx")


def test_the_f32_gguf_is_the_source_dequantized_with_its_metadata(tmp_path):
    from gguf.quants import dequantize, quantize
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    src = tmp_path / "q.gguf"
    writer = gguf.GGUFWriter(src, "llama")
    writer.add_block_count(1)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "c"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    q8 = quantize(w, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.ffn_down.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(64, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    out = lc.write_f32_gguf(src, tmp_path / "f32.gguf")
    r = gguf.GGUFReader(out)
    assert r.fields["general.file_type"].contents() == lc.F32
    assert r.fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "c"]
    assert r.fields["llama.block_count"].contents() == 1
    t = {x.name: x for x in r.tensors}
    got = np.array(t["blk.0.ffn_down.weight"].data)
    assert t["blk.0.ffn_down.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    want = dequantize(q8, gguf.GGMLQuantizationType.Q8_0)
    assert got.shape == (8, 64) and np.array_equal(got, want) and not np.array_equal(got, w)
    assert not (tmp_path / "f32.gguf.part").exists()


class _Fake(BaseHTTPRequestHandler):
    """llama-server's native streaming ``/completion``: ``server.mode`` picks the answer."""

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append((self.path, body))
        n = body["n_predict"]
        chunks = [{"content": "x", "tokens": [100 + k], "stop": False} for k in range(n)]
        if self.server.mode == "ok":  # the last chunk: no token, stop with its reason
            chunks.append({"content": "", "tokens": [], "stop": True, "stop_type": "limit"})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for c in chunks:
            self.wfile.write(f"data: {json.dumps(c)}\n\n".encode())
            self.wfile.flush()
        self.close_connection = True


@pytest.fixture
def fake():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    srv.mode, srv.bodies = "ok", []
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        t.join(timeout=10)


def test_the_backend_streams_every_requested_token(fake):
    b = lc.LlamaCppBackend(f"http://127.0.0.1:{fake.server_address[1]}", "m", clients=2,
                           timeout_s=30)
    try:
        (h,) = b.submit(sl.GenerationRequest((5, 6, 7), 4))
        ids = list(h.tokens(timeout=30))
        fake.mode = "cut"
        rec = sl._one(b, sl.Req((5, 6), 3), timeout_s=30)
    finally:
        b.close()
    assert ids == [100, 101, 102, 103] and h.finish_reason == "length"
    path, body = fake.bodies[0]
    assert path == "/completion" and body["prompt"] == [5, 6, 7] and body["n_predict"] == 4
    assert body["ignore_eos"] is True and body["return_tokens"] is True and body["stream"] is True
    assert rec.dropped and rec.tokens == 3  # a stream cut before its stop chunk is dropped


def test_serve_load_without_llama_server_reports_the_skip(tmp_path, one_thread):
    res = sl.main(["--models", "tiny", "--clients", "2", "--quick", "--json",
                   "--out", str(tmp_path), "--llama-server", str(tmp_path / "none")])
    m = res["model"]["tiny"]
    why = m["settings"][sl.LLAMACPP]["skipped"]
    assert "not an executable" in why and m["by_clients"]["2"][sl.LLAMACPP] == {"skipped": why}
    assert m["single_fresh"][sl.LLAMACPP] == {"skipped": why}
    assert lc.unavailable(None).startswith("no llama-server binary")
