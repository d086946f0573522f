"""One agent loop for training and evaluation: the prompt is the exported chat template's rendering
of the episode's messages and tools, and training and evaluation treat malformed calls and
missing preferences the same way."""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import os

import pytest

from nemo_orchestra.config import load_config
from nemo_orchestra.data.default_tasks import (
    generate_tasks,
    plan_head,
    plan_phrases,
    plan_positions,
    plan_text,
)
from nemo_orchestra.evaluation.harness import PolicyRun, run_all
from nemo_orchestra.prompting.chat import (
    QWEN3_CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    ChatFormat,
    format_tool_call,
    render_chat,
)
from nemo_orchestra.prompting.tokenizer import build_embedded_tokenizer
from nemo_orchestra.rollout.engines.base import Generation
from nemo_orchestra.rollout.loop import EnginePolicy, LoopLimits, Turn, format_error_observation, run_episodes
from nemo_orchestra.train.rollout_source import Episodes
from nemo_orchestra.rollout.managed_engine import ManagedEngine
from tools_env.client import ToolsEnvClient
from tools_env.supervisor import start_service
from tools_env.task import TaskRecord

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = [render_chat(QWEN3_CHAT_TEMPLATE, [{"role": "user", "content": t.problem}], []) for t in generate_tasks(40, 1)]
NO_PREFERENCE = TaskRecord(
    problem="What is 12 + 30?", answer="42", category="arithmetic", tools=["calculator", "answer"]
)
SCRIPT = [
    "<think>\nhm\n</think>\n\nthe answer is 42",  # no tool call: a format error
    "<think>\nanswer\n</think>\n\n" + format_tool_call("answer", {"answer": "42"}),
]


def _qwen3_style_tokenizer():
    """A byte-level BPE tokenizer laid out like Qwen3's: <|im_start|>/<|im_end|>/<|endoftext|> special,
    the tool and think tags added as non-special tokens, Qwen3's chat format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=800, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.add_tokens([t for t in SPECIAL_TOKENS if t not in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    fast.chat_template = QWEN3_CHAT_TEMPLATE
    return fast


TOKENIZERS = {
    "embedded": lambda: build_embedded_tokenizer(CORPUS, vocab_size=700, phrases=plan_phrases()),
    "qwen3_bpe": _qwen3_style_tokenizer,
}


@pytest.fixture(scope="module")
def service():
    with start_service({}) as handle:
        yield handle.urls


class ScriptedEngine:
    """Writes ``SCRIPT``'s turns in order, each as the tokenizer encodes it (with its end-of-turn id)."""

    def __init__(self, chat: ChatFormat):
        self.chat, self.seen = chat, []

    def generate(self, prompts, max_new_tokens, temperature, top_p, stop_ids, seeds=None):
        out = []
        for p in prompts:
            turn = self.chat.decode(p).count("<|im_start|>assistant") - 1
            ids = self.chat.encode(SCRIPT[min(turn, len(SCRIPT) - 1)]) + [stop_ids[0]]
            out.append(Generation(ids, [-0.1] * len(ids), True))
        return out


class Recording(EnginePolicy):
    """The engine policy, keeping each episode's first prompt: its messages, tools and token ids."""

    async def act(self, episodes):
        for e in episodes:
            if e.turn == 0:
                self.seen.append((e.group, copy.deepcopy(e.messages), copy.deepcopy(e.tools), list(e.traj.token_ids)))
        return await super().act(episodes)


def _ids(encoded):
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_prompt_ids_are_the_exported_chat_templates(service, tmp_path, kind):
    """The prompt training generates from is what ``transformers``' ``apply_chat_template`` makes of the
    same messages and tools with the exported tokenizer (what vLLM's OpenAI server runs), token for token;
    the whole episode's messages render to the text of its token ids."""
    from transformers import AutoTokenizer

    tokenizer = TOKENIZERS[kind]()
    tokenizer.save_pretrained(str(tmp_path / "tok"))
    exported = AutoTokenizer.from_pretrained(str(tmp_path / "tok"), local_files_only=True)
    chat = ChatFormat(tokenizer)
    policy = Recording(ScriptedEngine(chat), chat, max_new_tokens=64, temperature=1.0)
    policy.seen = []
    tasks = generate_tasks(6, seed=3) + [NO_PREFERENCE]
    client = ToolsEnvClient(service)

    async def go():
        try:
            return await run_episodes(
                tasks,
                policy,
                client,
                limits=LoopLimits(max_turns=3),
                default_preference={"accuracy": 1.0, "cost": 0.5, "latency": 0.5},
            )
        finally:
            await client.aclose()

    trajs = asyncio.run(go())
    assert len(policy.seen) == len(tasks)
    # in task order, as the trajectories: episodes reach the policy in the order their set-up finished
    seen = [s[1:] for s in sorted(policy.seen, key=lambda s: s[0])]
    for messages, tools, ids in seen:
        assert tools and messages[0]["role"] == "system"
        assert (
            _ids(exported.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)) == ids
        )
    for t, (_, tools, _) in zip(trajs, seen):
        assert t.format_errors == 1 and t.stop_reason == "answer"  # the first turn has no call
        # the malformed turn's span: the one token holding the character where it left every well-formed turn
        # (text where "<tool_call>" goes); the answering turn has none
        first, second = t.turns
        (start, end), plan = first.broken, "<think>\nhm\n</think>\n\n"
        before, token = chat.decode(t.token_ids[first.start : start]), chat.decode(t.token_ids[start:end])
        assert end == start + 1 and t.loss_mask[start] and len(before) <= len(plan) < len(before + token)
        assert plan.startswith(before) and (before + token).startswith(plan) and second.broken is None
        rendered = exported.apply_chat_template(t.messages, tools=tools, tokenize=False)
        assert rendered == chat.decode(t.token_ids) + "\n"


def _evaluate_recipe():
    spec = importlib.util.spec_from_file_location("evaluate_recipe", os.path.join(REPO, "recipes", "evaluate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ScriptedMessages:
    """A message-level policy (as an OpenAI endpoint is) writing ``SCRIPT``'s turns as text."""

    name, chat = "scripted", None

    async def act(self, episodes):
        return [Turn(SCRIPT[min(e.turn, len(SCRIPT) - 1)], prompt_tokens=1, completion_tokens=1) for e in episodes]

    async def aclose(self):
        pass


def test_training_and_evaluation_agree_on_malformed_calls_and_missing_preferences(service):
    """A record without a preference and a turn without a call, once through the trainer's rollout
    (token ids, the engine as policy) and once through evaluate's runner (messages): the same
    conversation, the same error observation, the same default preference in the prompt and task."""
    cfg = load_config(["rollout.max_turns=3", "rollout.max_context=4096"])
    chat = ChatFormat(TOKENIZERS["embedded"]())
    client = ToolsEnvClient(service)
    generation = ManagedEngine(engine=ScriptedEngine(chat))
    episodes = Episodes(
        cfg.rollout, cfg.reward.default_preference, generation, chat, client, asyncio.new_event_loop(), ""
    )
    trained = episodes.run([NO_PREFERENCE], 1, 1.0, "", step=0)[0]
    run = PolicyRun(ScriptedMessages(), LoopLimits(max_turns=3), _evaluate_recipe().EvalConfig().default_preference)
    evaluated = episodes.loop.run_until_complete(
        run_all(client, [run], [NO_PREFERENCE], {"record": None}, progress=False)
    )
    episodes.loop.run_until_complete(client.aclose())
    assert evaluated[0].format_errors == trained.format_errors == 1
    assert evaluated[0].correct and trained.correct
    assert evaluated[0].messages == trained.messages
    assert trained.messages[3] == {
        "role": "tool",
        "content": format_error_observation("no <tool_call>...</tool_call> in the turn"),
    }
    assert trained.task.preference == cfg.reward.default_preference
    assert "Preference weights: accuracy 1, cost 0.5, latency 0.5." in trained.messages[1]["content"]


class CallsThenAnswers:
    """A message-level policy that makes ``calls`` in order, then answers 42."""

    name, chat = "calls", None

    def __init__(self, calls):
        self.calls = calls

    async def act(self, episodes):
        turns = []
        for e in episodes:
            name, args = self.calls[e.turn] if e.turn < len(self.calls) else ("answer", {"answer": "42"})
            turns.append(Turn(format_tool_call(name, args), prompt_tokens=1, completion_tokens=1))
        return turns

    async def aclose(self):
        pass


@pytest.mark.parametrize(
    "call, fits",
    [
        (("calculator", {"expression": "12 + 30"}), True),
        (("calculator", {"model": "expert-small"}), False),  # another tool's argument, its own missing
        (("calculator", {"expression": "12 + 30", "answer": "42"}), False),  # an argument it does not take
        (("expert", {"model": "expert-huge", "query": "12 + 30"}), False),  # outside the alias enum
        (("search", {"query": "12 + 30"}), False),  # a tool this task does not offer
        (("calculator", {"expression": 42}), False),  # the wrong JSON type
    ],
)
def test_a_call_that_does_not_fit_the_offered_tools_is_a_schema_error(service, call, fits):
    """A call that parses but does not fit the episode's tool schemas is counted as malformed
    (``schema_errors``), exactly the calls the service refuses with an error observation."""
    from nemo_orchestra.prompting.chat import ToolCall
    from nemo_orchestra.rollout.loop import call_schema_error

    task = TaskRecord(
        problem="What is 12 + 30?", answer="42", category="arithmetic", tools=["calculator", "expert", "answer"]
    )
    client = ToolsEnvClient(service)

    async def go():
        try:
            ep = await client.create_episode(task.to_dict())
            await client.delete_episode(ep["episode_id"])
            trajs = await run_episodes(
                [task], CallsThenAnswers([call]), client, limits=LoopLimits(max_turns=3), default_preference={}
            )
            return ep["tools"], trajs[0]
        finally:
            await client.aclose()

    tools, t = asyncio.run(go())
    assert t.format_errors == 0 and t.correct and t.stop_reason == "answer"
    assert t.schema_errors == (0 if fits else 1)
    assert (t.tool_errors == 0) == fits  # the service refused the same calls
    assert (call_schema_error(ToolCall(*call), tools) is None) == fits


class PlanThenAnswer:
    """Writes one turn per episode: the plan ``plan_text`` makes for the task's kind under profile
    ``stated[i]`` (the i-th task's), then a call to answer 42, each as the tokenizer encodes it."""

    def __init__(self, chat: ChatFormat, tasks, stated):
        self.chat = chat
        self.by_problem = {t.problem: (t.category, s) for t, s in zip(tasks, stated)}

    def generate(self, prompts, max_new_tokens, temperature, top_p, stop_ids, seeds=None):
        out = []
        for p in prompts:
            text = self.chat.decode(p)
            category, name = next(v for k, v in self.by_problem.items() if k in text)
            turn = plan_text(category, name, "answer", {"answer": "42"}) + format_tool_call("answer", {"answer": "42"})
            ids = self.chat.encode(turn) + [stop_ids[0]]
            out.append(Generation(ids, [-0.1] * len(ids), True))
        return out


@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_a_plan_that_misstates_its_task_is_counted(service, kind):
    """A plan restates the task's kind and the user's preference; one that states another is a plan error
    (``Trajectory.plan_errors``); a plan stated right and a task without a profile are not. The call after it
    runs as any other."""
    chat = ChatFormat(TOKENIZERS[kind]())
    tasks = [t for t in generate_tasks(8, seed=5) if t.category in ("lookup", "reasoning")][:2]
    other = {"accuracy_first": "cost_sensitive", "cost_sensitive": "accuracy_first"}
    stated = [other[tasks[0].meta["preference_name"]], tasks[1].meta["preference_name"], "cost_sensitive"]
    tasks.append(TaskRecord(problem="What is 12 + 33?", answer="42", category="arithmetic", tools=["answer"]))
    policy = EnginePolicy(PlanThenAnswer(chat, tasks, stated), chat, max_new_tokens=64, temperature=1.0)
    client = ToolsEnvClient(service)

    async def go():
        try:
            return await run_episodes(tasks, policy, client, limits=LoopLimits(max_turns=3), default_preference={})
        finally:
            await client.aclose()

    trajs = asyncio.run(go())
    assert [t.plan_errors for t in trajs] == [1, 0, 0]
    assert all(t.format_errors + t.schema_errors == 0 and t.stop_reason == "answer" for t in trajs)
    assert all(r.broken is None for t in trajs for r in t.turns)
    # the one-token plans whose restatement trains (loss.restatement_coef): the embedded tokenizer's, at the token
    # after <think>, with every plan that states its task's kind and preference; Qwen3's BPE writes none in one
    plans = [plan_positions(t, chat) for t in trajs]
    if kind != "embedded":
        assert plans == [[], [], []]
        return
    assert [len(p) for p in plans] == [1, 1, 0]
    for t, [(k, ids)], name in zip(trajs[:2], plans, stated):
        assert chat.decode([t.token_ids[k]]) == plan_text(t.task.category, name, "answer", {"answer": "42"})[7:-9]
        right = plan_head(t.task.category, t.task.meta["preference_name"])
        texts = [chat.decode([i]) for i in ids]  # its eight actions: answer by or ask three experts, two tools
        assert len(ids) == 8 and all(x.startswith(right + ": ") for x in texts)
        assert (t.token_ids[k] in ids) == (name == t.task.meta["preference_name"])
