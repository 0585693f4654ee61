"""``dflash eval``: speculative decoding with the target and an exported drafter (docs/data-flow.md#eval).

Public API:
  benches.load_mt_bench / load_humaneval -> BenchQuestion               standard question sets (PyPI wheels)
  prompts.resolve_held_out / select_prompts                             held-out chat prompts (--turns)
  validation_set.select_validation_prompts                              the training run's held-out records
  cache_data.iter_cache_records                                         a cache's records: ids, roots, origins
  question_decoding.decode_question                                     one question, turn by turn, both ways
  exactness.classify -> Divergence                                      identical / near-tie / mismatch
  run.EvalConfig / run_eval(config) -> report.EvalReport (format_table, write_json)
"""
