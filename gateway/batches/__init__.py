"""OpenAI Batch API: files of requests, jobs that run them in the background, their output files.

- `config.py`   the `batches:` config section
- `objects.py`  the file and batch objects as OpenAI shapes them, and their ids
- `input.py`    checking an uploaded JSONL file, line by line
- `files.py`    file bodies on disk (the configured directory), metadata in the state store
- `book.py`     batch records in the state store: create, read, list, cancel, line marks
- `dispatch.py` one line through the gateway's core, as the job's tenant, in the background class
- `job.py`      one job: resume where it stopped, run its lines, finalize its output files
- `runner.py`   the background task that claims jobs and runs them (one replica per job)
- `routes.py`   the HTTP routes (`/v1/files`, `/v1/batches`)
"""
