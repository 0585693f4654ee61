"""``dflash regenerate``: the target answers the user turns of chat data (DESIGN §5: training responses
should come from the target itself).

Public API:
  config.RegenerateConfig / run.run_regenerate(config) -> RegenerateSummary
  turns.user_groups, turns.PendingConversation   which turns are answered, and the chat built
  generation.generate_batch                      left-padded HF generate, greedy or sampled
  jsonl_out.ResumableJsonl                       append-only JSONL that a killed run resumes
"""
