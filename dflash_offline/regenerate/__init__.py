"""``dflash regenerate``: the target answers the user turns of chat data (training responses should come
from the target itself: docs/data-flow.md#regenerate).

Public API:
  config.RegenerateConfig / run.run_regenerate(config) -> RegenerateSummary
  pending_conversation.PendingConversation       the chat built from the target's answers (which turns
                                                 are answered: data/user_groups.py)
  engine_protocol.Engine, EngineOptions          what every engine keeps to (``Finished`` out); slots' knobs
  slot_engine.SlotEngine                         the project's decode engine (--engine auto|slots)
  openai_engine.OpenAIEngine, probe_server       an OpenAI-compatible server's completions (--engine openai)
  http_client.JsonClient                         JSON over HTTP with per-request timeout and retries
  served_answer.parse_served_answer              a server's answer checked against the request
  driver.Driver                                  a window of conversations, each turn submitted when ready
  worker.run_worker                              one worker (its device, its share of the records)
  generation.GenerationSettings                  how answers are drawn (greedy, or seeded sampling)
  jsonl_out.ResumableJsonl, merge_parts          append-only JSONL that a killed run resumes; part merging
"""
