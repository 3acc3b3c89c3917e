"""The machinery that runs the tests, apart from them: processes and ports (processes), the prewarm server that forks
a test's runs from an interpreter that imported torch once (prewarm), the runs that tests share, started ahead in the
background (ahead), and the jobs a test starts, none of which outlives it (jobs)."""
