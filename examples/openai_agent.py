"""An ``openai``-client agent trained through the pipeline: it solves the calculator task
with the ``calculate`` tool, played by the shipped tools warm start.

The agent sends what the calculator ToolEnv shows the model (its system prompt, its
question, the tool's schema), the conversation the warm start was trained on, so the
model's calls are well formed. Run: ``python examples/openai_agent.py``.
"""

import json

from transformers.utils import get_json_schema

from rollpipe import EpisodeSettings, PipelineConfig, RolloutPipeline, VLLMEngine
from rollpipe.envs import register
from rollpipe.envs.calculator import calculate, calculator_task, last_number_matches
from rollpipe.envs.tool_env import DEFAULT_TOOL_PROMPT
from rollpipe.frontdoor import AgentEnv, AgentResult
from rollpipe.training.tool_warm_start import tool_warm_start_model_path

TOOLS = [get_json_schema(calculate)]  # the schema ToolEnv shows for the same function


async def agent(client, task):  # client: openai.AsyncOpenAI, with this episode's key
    question, truth = task
    messages = [
        {"role": "system", "content": DEFAULT_TOOL_PROMPT},  # ToolEnv's, as trained
        {"role": "user", "content": question},
    ]
    for _ in range(3):
        reply = await client.chat.completions.create(model="any", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            reward = last_number_matches(message.content or "", truth)
            return AgentResult(reward, success=reward > 0)
        for call in message.tool_calls:
            try:  # arguments are the model's JSON: check them before use, as OpenAI says
                result = calculate(**json.loads(call.function.arguments))
            except Exception as exc:  # not JSON, not an object, not an expression
                result = f"error: {exc!r}"  # the model reads what was wrong
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return AgentResult(0.0)


def main(engine=None, batch_size=256):
    register(
        "openai-calculator-agent",
        lambda: AgentEnv(agent, task=lambda seed: calculator_task(seed, digits=1)),
        overwrite=True,
    )
    path = tool_warm_start_model_path()  # shipped in the package: nothing to build
    owned = engine is None
    engine = engine or VLLMEngine(path)
    episode = EpisodeSettings(tool_parser="hermes", sampling={"max_tokens": 48})
    config = PipelineConfig(
        envs="openai-calculator-agent", episode=episode, group_size=4, batch_size=batch_size
    )
    with RolloutPipeline(config, engine, path, owns_engine=owned) as pipe:
        batch = pipe.get_batch()
    metrics = batch.meta_info["metrics"]
    for key in ("tool/calls", "tool/malformed", "success_rate", "episode_score/mean"):
        print(f"{key}: {metrics[key]:g}")
    return batch


if __name__ == "__main__":
    main()
