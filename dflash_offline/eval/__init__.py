"""``dflash eval``: speculative decoding with the target and an exported drafter (DESIGN §5).

Public API:
  speculative.speculative_decode / target_only_decode -> DecodeResult   the two loops (greedy, batch 1)
  speculative.BlockDrafter (protocol), DFlashBlockDrafter, TargetCaller
  prompts.resolve_held_out / select_prompts                             held-out prompts
  run.EvalConfig / run_eval(config) -> report.EvalReport (format_table, write_json)
  runtime.resolve_device / compute_dtype / stop_token_ids              shared with regenerate
"""
