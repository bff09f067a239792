"""End to end, media: the `media` app (tests/support/serving_apps.py) on a real local Ray Serve: the
default app's embedding model, a Whisper replica (/v1/audio/*), a LLaVA replica (chat with
images) and a cross-encoder (/v1/rerank, /v1/score), each answering as transformers does."""

from __future__ import annotations

import pytest

from tests.support.serving_apps import EMBEDDER, MODEL, MODEL_LLAVA, MODEL_RERANKER, MODEL_WHISPER

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def client(media_app):
    return media_app.client


def test_models(client, whisper_dir, llava_dir):
    listed = client.models.list().data
    assert [m.id for m in listed] == [EMBEDDER, MODEL_WHISPER, MODEL_LLAVA, MODEL_RERANKER]
    assert {m.id: m.model_extra["root"] for m in listed if m.id != MODEL_RERANKER} == {
        EMBEDDER: EMBEDDER, MODEL_WHISPER: str(whisper_dir), MODEL_LLAVA: str(llava_dir)}
    assert {m.id: m.task for m in listed} == {EMBEDDER: "embed", MODEL_WHISPER: "transcribe", MODEL_LLAVA: "generate",
                                              MODEL_RERANKER: "score"}
    assert {m.id: m.model_extra["dimensions"] for m in listed if m.id == EMBEDDER} == {EMBEDDER: 384}


def test_a_cross_encoder_reranks_through_ray_serve(client):
    """/v1/rerank and /v1/score on a score replica: transformers' sigmoid of each pair's logit,
    sorted, with the tokens of every pair counted."""
    import numpy as np

    root = next(m.model_extra["root"] for m in client.models.list().data if m.id == MODEL_RERANKER)
    query, documents = "what is the capital of france", ["paris is the capital of france", "bananas are yellow",
                                                         "a long sentence with many words in it"]
    tokenizer = transformers.BertTokenizerFast.from_pretrained(root)
    model = transformers.BertForSequenceClassification.from_pretrained(root).eval()
    encoded = [tokenizer(query, d, return_tensors="pt") for d in documents]
    with torch.no_grad():
        want = np.array([float(torch.sigmoid(model(**e).logits[0, 0].double())) for e in encoded])
    tokens = sum(e["input_ids"].shape[1] for e in encoded)
    body = client.post("/rerank", cast_to=object, body={"model": MODEL_RERANKER, "query": query,
                                                        "documents": documents, "top_n": 2})
    order = sorted(range(len(documents)), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in body["results"]] == order
    assert np.abs(np.array([r["relevance_score"] for r in body["results"]]) - want[order]).max() <= 1e-4
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    scored = client.post("/score", cast_to=object, body={"model": MODEL_RERANKER, "text_1": query,
                                                         "text_2": documents})
    assert np.abs(np.array([d["score"] for d in scored["data"]]) - want).max() <= 1e-4


def test_the_default_apps_embedding_model_puts_paraphrases_closest(client):
    """all-MiniLM-L6-v2 from the shipped config, next to a speech and an image-chat model behind the
    same endpoint."""
    import numpy as np

    from engine.formats.model_sources import resolve_model

    texts = ["Paris is the capital of France", "The French capital is Paris", "Bananas are yellow"]
    response = client.embeddings.create(model=EMBEDDER, input=texts)
    paris, paraphrase, bananas = (np.array(d.embedding) for d in response.data)
    assert len(paris) == 384 and np.isclose(np.linalg.norm(paris), 1.0, atol=1e-5)
    assert paris @ paraphrase > 0.8 > 0.2 > paris @ bananas
    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model(EMBEDDER))
    assert response.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in texts) == 20
    tasks = {m.id: m.task for m in client.models.list().data}
    assert tasks[EMBEDDER] == "embed" and tasks[MODEL_LLAVA] == "generate"


def test_speech_to_text_through_ray_serve(client, whisper_dir):
    """A Whisper replica in the same app: the openai client's transcription and stream, and the
    speech model listed as such; its 30-second windows equal transformers' long-form generate."""
    import io
    import wave

    import numpy as np

    from serve_app.media.audio import log_mel

    samples = (np.random.RandomState(4).randn(16000 * 35) * 3000).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1), out.setsampwidth(2), out.setframerate(16000), out.writeframes(samples.tobytes())
    file = ("speech.wav", buffer.getvalue())
    answer = client.audio.transcriptions.create(model=MODEL_WHISPER, file=file, language="en",
                                                response_format="verbose_json",
                                                timestamp_granularities=["segment", "word"])
    model = transformers.WhisperForConditionalGeneration.from_pretrained(whisper_dir).eval()
    mel = log_mel(samples.astype(np.float32) / 32768, 80)
    with torch.no_grad():
        out = model.generate(torch.tensor(mel[None]), attention_mask=torch.ones((1, mel.shape[1]), dtype=torch.long),
                             language="en", task="transcribe", return_timestamps=True, return_segments=True,
                             return_token_timestamps=True)
    tokenizer, eot = transformers.AutoTokenizer.from_pretrained(whisper_dir), model.generation_config.eos_token_id
    segments = [s["tokens"].tolist() for s in out["segments"][0]]
    assert answer.text == tokenizer.decode([t for tokens in segments for t in tokens if t < eot]).strip()
    worded = [tokens for tokens in segments if tokenizer.decode([t for t in tokens if t < eot]).strip()]
    assert [s.tokens for s in answer.segments] == worded
    assert answer.duration == 35.0 and answer.language == "english"
    # each word ends where transformers' token timestamps say its last token ends
    ends = {round(min(float(t), 35.0), 2) for s in out["segments"][0] for t in s["token_timestamps"]}
    assert answer.words and {w.end for w in answer.words} <= ends
    assert "".join(w.word for w in answer.words) == "".join(answer.text.split())
    events = list(client.audio.transcriptions.create(model=MODEL_WHISPER, file=file, language="en", stream=True))
    assert events[-1].type == "transcript.text.done" and events[-1].text == answer.text
    assert "".join(e.delta for e in events[:-1]) == answer.text
    tasks = {m.id: m.task for m in client.models.list().data}
    assert tasks[MODEL_WHISPER] == "transcribe"
    with pytest.raises(openai.BadRequestError, match="speech-to-text model"):
        client.embeddings.create(model=MODEL_WHISPER, input="hello")


def test_chat_with_an_image_through_ray_serve(client, llava_dir, text_app):
    """A LLaVA replica in the same app: an image_url part crosses the Ray hops and the answer is
    transformers' greedy one."""
    from tests.support.parity import llava_greedy, png_data_uri

    uri, picture = png_data_uri(3)
    answer = client.chat.completions.create(
        model=MODEL_LLAVA, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri, "detail": "low"}},
                                               {"type": "text", "text": "Describe it."}]}])
    text, prompt_tokens = llava_greedy(llava_dir, [{"role": "user", "content": "<image>\nDescribe it."}], [picture], 6)
    assert answer.choices[0].message.content == text and answer.usage.prompt_tokens == prompt_tokens
    with pytest.raises(openai.BadRequestError, match="takes no images"):
        text_app.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": uri}}]}])
