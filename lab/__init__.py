"""The lab: what produces the numbers in docs/ and README.md, not what a user needs to train, sample or score.
Benchmarks (bench*), the authors' code loaded beside ours (paper_code) and the parity harness (paper_parity),
the toy study's report (study_report) and reference limit (digits_reference_limit), guidance at equal cost
(guidance_eval), REPA's teacher cost (repa_cost), and the digits classifier's training. Each runs as
`python -m lab.<name>`; nothing in the product imports them."""
