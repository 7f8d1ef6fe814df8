"""`agent.init_from` a Hugging Face checkpoint with its own tokenizer, and `export` back, against `transformers` on
tiny checkpoints built here (tests/model/tiny_hf.py: Qwen3 with a BPE tokenizer.json, Gemma with SentencePiece)."""

import json
import unicodedata

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mgrpo_jax.agent import export
from mgrpo_jax.agent.build import agent_tokenizer, build_agent
from mgrpo_jax.agent.state import model_from_state
from mgrpo_jax.config import get_config
from mgrpo_jax.env.prompts import SYSTEM
from mgrpo_jax.env.protocol import valid_unicode
from mgrpo_jax.model import token_logprobs
from mgrpo_jax.rl.trainer import Trainer
from mgrpo_jax.tokenizer import PROTOCOL_TAGS, Tokenizer
from mgrpo_jax.tokenizer_hf import HFTokenizer, WithAddedTokens, load_checkpoint_tokenizer, write_tokenizer_files
from tests.model.tiny_hf import smoke_corpus, tiny_gemma, tiny_llama3, tiny_qwen3

TAGGED = [("system", "You are the main agent. Use tools."), ("user", "Question: Who founded Varn Corp in 1987?"),
          ("assistant", '<think>look</think><tool_call>{"name": "search", "arguments": {"query": "Varn  Corp"}}'
                        "</tool_call>"),
          ("tool", "<tool_response>1. Varn Corp — founded 1987 by Ada\n  Lovelace. ünï 😀</tool_response>"),
          ("assistant", "<answer>Ada Lovelace</answer>")]
PLAIN = [(role, text) for role, text in TAGGED[:2]] + [("assistant", "Let me add: 12 + 30 = 42.\n\nDone"),
                                                       ("tool", "1. Varn Corp — founded 1987.")]


@pytest.fixture(scope="module")
def corpus():
    return smoke_corpus(limit_questions=10)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, corpus):
    return tiny_qwen3(tmp_path_factory.mktemp("qwen3"), corpus)


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory, corpus):
    return tiny_llama3(tmp_path_factory.mktemp("llama3"), corpus)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory, corpus):
    return tiny_gemma(tmp_path_factory.mktemp("gemma"), corpus)


def _hf_ids(tok, messages, generation_prompt):
    ids = tok.apply_chat_template([{"role": r, "content": t} for r, t in messages], tokenize=True,
                                  add_generation_prompt=generation_prompt)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("family", ["qwen3", "gemma", "llama3"])
def test_rendered_chat_ids_equal_transformers_apply_chat_template(family, request, tmp_path):
    directory = request.getfixturevalue(f"{family}_dir")
    ours = load_checkpoint_tokenizer(directory, PROTOCOL_TAGS)
    hf = transformers.AutoTokenizer.from_pretrained(directory)
    for prompt in (False, True):
        assert ours.render_chat(PLAIN, add_generation_prompt=prompt)[0] == _hf_ids(hf, PLAIN, prompt)
    # The chat tags: the checkpoint's own special tokens where it has them, appended after its vocabulary otherwise.
    assert isinstance(ours, WithAddedTokens)
    if family == "qwen3":
        assert isinstance(ours.base, HFTokenizer) and ours.chat_format.name == "chatml"
        assert ours.token_id("<tool_call>") == hf.convert_tokens_to_ids("<tool_call>") < len(hf)
        assert list(ours.added) == ["<answer>", "</answer>"]
    else:
        assert ours.chat_format.name == family and len(ours.added) == len(PROTOCOL_TAGS)
    base = ours.base.vocab_size  # appended right after the checkpoint tokenizer's own vocabulary
    assert sorted(ours.added.values()) == list(range(base, base + len(ours.added)))
    # The exported tokenizer files render the tagged conversation (and every tag as one token) as we do.
    write_tokenizer_files(ours, directory, tmp_path)
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids, mask = ours.render_chat(TAGGED)
    assert ids == _hf_ids(exported, TAGGED, False)
    assert all(len(exported.encode(tag, add_special_tokens=False)) == 1 for tag in PROTOCOL_TAGS)
    # Only the assistants' content and end-of-turn tokens are trained; decoding gives the text back.
    assistant = [ours.encode(t) + [ours.end_of_turn_id] for r, t in TAGGED if r == "assistant"]
    assert [i for i, m in zip(ids, mask, strict=True) if m] == [i for turn in assistant for i in turn]
    assert ours.decode(ours.encode(TAGGED[3][1])) == TAGGED[3][1]


def _hf_logprobs(model, tokens):
    with torch.no_grad():
        logits = model(input_ids=torch.as_tensor([tokens])).logits[0].double()
    return torch.log_softmax(logits, -1)[:-1].gather(1, torch.as_tensor(tokens[1:])[:, None])[:, 0].numpy()


def _hf_with_mean_rows(directory, added_ids):
    """The checkpoint in transformers, its appended tokens' rows set as `init_from` sets them (mean rows)."""
    return _hf_with_mean_rows_model(
        transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval(), added_ids)


def _hf_with_mean_rows_model(model, added_ids):
    real = min(added_ids)
    with torch.no_grad():
        for table in {id(t): t for t in (model.get_input_embeddings().weight,
                                          model.get_output_embeddings().weight)}.values():
            table[added_ids] = table[:real].mean(0)
    return model


@pytest.mark.slow
def test_smoke_run_from_a_qwen3_checkpoint_and_its_export(qwen3_dir, tmp_path):
    config = get_config("xbench", "smoke")
    config.main.init_from = str(qwen3_dir)
    trainer = Trainer(config, str(tmp_path / "run"))
    main, sub = trainer.agents["main"], trainer.agents["sub"]
    assert list(main.tokenizer.added) == ["<answer>", "</answer>"] and sub.tokenizer is trainer.tokenizer
    assert main.model_config.vocab_size == 1024 and main.model_config.family == "qwen3"  # padding rows took them

    # A sampled episode: its first teacher-forced log-probs are transformers' on the same ids (to 1e-5), and it
    # decodes to the text the environment wrote and the agent sampled.
    batch = trainer.engine.run(trainer.feed.questions[:1], 1, seed=0)
    episode = batch.top[0][0]
    tokens = np.asarray(episode.tokens, np.int32)[None]
    ours = np.asarray(token_logprobs(model_from_state(main.graphdef, main.state), jnp.asarray(tokens),
                                     jnp.arange(tokens.shape[1])[None], jnp.ones(tokens.shape, bool)))[0, 1:]
    reference = _hf_with_mean_rows(qwen3_dir, list(main.tokenizer.added.values()))
    assert np.abs(ours - _hf_logprobs(reference, episode.tokens)).max() < 1e-5
    trained = np.asarray(episode.loss_mask, bool)
    assert np.abs(np.asarray(episode.logprobs)[trained] - ours[trained[1:]]).max() < 1e-4  # the sampler's
    text = main.tokenizer.decode(episode.tokens)
    assert text.startswith(f"<|im_start|>{SYSTEM}\n{trainer.engine.top.system_prompt}<|im_end|>\n<|im_start|>user\n")
    assert trainer.feed.questions[0].text in text and all(turn in text for turn in episode.turns)
    for sub_episode in episode.subs:  # the task crossed as text, tokenized by the sub-agent's own tokenizer
        assert sub_episode.call["task"] in sub.tokenizer.decode(sub_episode.tokens)

    # The run, then its export: transformers loads it with the same logits and the agent's tokenizer.
    export.record_agents(trainer.workdir, trainer.agents)
    trainer.run()
    written = export.export_agents(trainer)
    out = tmp_path / "run" / "export" / "main"
    assert str(out) in written
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours_final = np.asarray(token_logprobs(model_from_state(main.graphdef, main.state), jnp.asarray(tokens),
                                           jnp.arange(tokens.shape[1])[None], jnp.ones(tokens.shape, bool)))[0, 1:]
    assert np.abs(ours_final - _hf_logprobs(hf, episode.tokens)).max() < 1e-5
    assert np.abs(ours_final - ours).max() > 1e-4  # it trained (warm start and RL moved it)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert main.tokenizer.render_chat(TAGGED)[0] == _hf_ids(hf_tok, TAGGED, False)
    sub_out = tmp_path / "run" / "export" / "sub"  # the sub-agent: its random-init Qwen3 and our tokenizer
    assert transformers.AutoModelForCausalLM.from_pretrained(sub_out).config.model_type == "qwen3"
    assert sub.tokenizer.render_chat(TAGGED)[0] == _hf_ids(transformers.AutoTokenizer.from_pretrained(sub_out),
                                                           TAGGED, False)
    # The command-line export of the latest checkpoint writes the same weights.
    cli = export.export_checkpoint(str(tmp_path / "run"), "main", str(tmp_path / "cli"))
    again = transformers.AutoModelForCausalLM.from_pretrained(cli, dtype=torch.float32).eval()
    for (name, a), (_, b) in zip(hf.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert json.loads((tmp_path / "cli" / "tokenizer_config.json").read_text())["added_tokens_decoder"]["1000"][
        "content"] == "<answer>"


def test_export_names_a_workdir_without_agents(tmp_path):
    with pytest.raises(export.ExportError, match="not a run's workdir"):
        export.export_checkpoint(str(tmp_path), "nope", str(tmp_path / "out"))


def test_gemma_agent_grows_its_vocabulary_on_a_sharded_mesh(gemma_dir):
    """Gemma's SentencePiece vocabulary has no padding rows: the 8 chat tags grow the (tied) embedding by 8 rows,
    mean-initialised, sharded on the agent's mesh; its log-probs equal transformers' with the same rows."""
    config = get_config("xbench", "smoke")
    config.main.init_from = str(gemma_dir)
    config.main.mesh.update({"data": 2, "fsdp": 2, "tensor": 2})
    tokenizer = agent_tokenizer(config, "main", shared=None)
    agent = build_agent("main", config.main, tokenizer, jax.devices()[:8], seed=0)
    size = tokenizer.base.vocab_size
    assert agent.model_config.vocab_size == size + len(PROTOCOL_TAGS) == tokenizer.vocab_size
    assert agent.model_config.family == "gemma" and agent.model_config.tie_embeddings
    embed = agent.state.params["embed"]
    assert embed.shape[0] == size + len(PROTOCOL_TAGS) and len(embed.sharding.device_set) == 8
    ids, _ = tokenizer.render_chat(TAGGED)
    assert max(ids) >= size  # the tags' new rows are used
    hf = transformers.AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()
    hf.resize_token_embeddings(tokenizer.vocab_size, mean_resizing=False)
    reference = _hf_with_mean_rows_model(hf, list(range(size, tokenizer.vocab_size)))
    tokens = jnp.asarray([ids], jnp.int32)
    ours = np.asarray(token_logprobs(model_from_state(agent.graphdef, agent.state), tokens,
                                     jnp.arange(len(ids))[None], jnp.ones(tokens.shape, bool)))[0, 1:]
    assert np.abs(ours - _hf_logprobs(reference, ids)).max() < 1e-5


def test_our_sentencepiece_tokenizer_exports_for_transformers(corpus, tmp_path):
    """An agent without `init_from` exports the run's SentencePiece model with our chat template."""
    ours = Tokenizer.train(corpus, 600)
    write_tokenizer_files(ours, None, tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for prompt in (False, True):
        assert ours.render_chat(TAGGED, add_generation_prompt=prompt)[0] == _hf_ids(hf, TAGGED, prompt)


def test_init_from_a_gs_url_loads_what_the_local_directory_gives(qwen3_dir):
    """The checkpoint and its tokenizer read from a bucket (the local GCS emulator) equal the local ones."""
    from tests.store import conftest as store_conftest  # sets the emulator's endpoint before gcsfs is imported

    with store_conftest.shared_emulator():  # this worker's session emulator when the store tests started it
        import gcsfs

        url = f"gs://{store_conftest.BUCKET}/checkpoints/{qwen3_dir.name}"
        fs = gcsfs.GCSFileSystem(token="anon")
        for path in qwen3_dir.iterdir():
            fs.put(str(path), f"{url}/{path.name}")
        agents = {}
        for where in (str(qwen3_dir), url):
            config = get_config("xbench", "smoke")
            config.main.init_from = where
            tokenizer = agent_tokenizer(config, "main", shared=None)
            agents[where] = build_agent("main", config.main, tokenizer, jax.devices()[:1], seed=0)
    local, remote = agents[str(qwen3_dir)], agents[url]
    assert remote.tokenizer.render_chat(TAGGED) == local.tokenizer.render_chat(TAGGED)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 remote.state.params, local.state.params)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.one_of(st.sampled_from(PROTOCOL_TAGS + ("<|im_end|>",)), st.text(max_size=12)), max_size=8))
def test_qwen3_tokenizer_round_trips_text_with_tags(qwen3_dir, parts):
    """decode(encode(s)) == s for NFC text (Qwen's normaliser), every chat tag one id, ids outside the vocabulary
    decode as U+FFFD."""
    tok = load_checkpoint_tokenizer(qwen3_dir, PROTOCOL_TAGS)
    text = unicodedata.normalize("NFC", valid_unicode("".join(parts)))
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert sum(i in tok.added.values() for i in ids) == sum(text.count(t) for t in tok.added)
    assert tok.decode([tok.vocab_size + 5]) == "\ufffd"
