"""The report of `twinflash compare`: its dict from the jobs' results (data.py), what renderings and plots both read
(fields.py), report.md and report.html (render.py), the plots (plots.py), the schema check and the writing
(write.py, schema.json), and the peers' numbers (peers.json)."""
