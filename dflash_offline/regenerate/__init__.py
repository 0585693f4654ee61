"""``dflash regenerate``: the target answers the user turns of chat data (training responses should come
from the target itself: docs/data-flow.md#regenerate).

Public API:
  config.RegenerateConfig / run.run_regenerate(config) -> RegenerateSummary
  pending_conversation.PendingConversation       the chat built from the target's answers (which turns
                                                 are answered: data/user_groups.py)
  engine_protocol.Engine, EngineOptions          what every engine keeps to and takes (``Finished`` out)
  engines.ContinuousEngine / StaticEngine        transformers' continuous batching / sorted generate batches
  openai_engine.OpenAIEngine, probe_server       an OpenAI-compatible server's completions (--engine openai)
  http_client.JsonClient                         JSON over HTTP with per-request timeout and retries
  driver.Driver                                  a window of conversations, each turn submitted when ready
  worker.run_worker                              one worker (its device, its share of the records)
  generation.generate_batch                      left-padded HF generate, greedy or sampled
  jsonl_out.ResumableJsonl, merge_parts          append-only JSONL that a killed run resumes; part merging
"""
