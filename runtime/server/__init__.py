"""The HTTP room: one Starlette app (app.py) over an AppState the bootstrap fills in (state.py), handlers
loaded by name (handler.py), the engine as handlers see it (engine_view.py), OpenAI errors (errors.py),
SSE (sse.py), metrics (metrics.py), uvicorn serving with drain (serve.py), and the AWS Lambda runtime
(lambda_runtime.py, lambda_http.py). Nothing here imports torch."""
