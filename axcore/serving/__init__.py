"""`axcore serve`'s HTTP server: the OpenAI API over any `axcore.engine.requests.EngineClient`.

    from axcore.serving import ServerSettings, TextFrontend, create_app, make_server

    app = create_app(engine, TextFrontend(tokenizer, chat_template), ServerSettings(max_waiting=64))
    make_server(app, host="127.0.0.1", port=8000).run()

`protocol` holds the request models and error bodies, `text` the tokenizer and chat
template side, `runs` the engine requests in flight (merging, the waiting bound,
cancellation), `responses` the answers and streamed chunks, `metrics` `/metrics`, `app`
the routes, `server` uvicorn and the loopback rule. Needs the `serve` extra (FastAPI,
uvicorn, prometheus-client); only `axcore.cli` imports this package.
"""

from axcore.serving.app import ServerSettings, ServerState, create_app
from axcore.serving.protocol import RequestError
from axcore.serving.server import ServeError, check_host, make_server
from axcore.serving.text import TextFrontend

__all__ = ["RequestError", "ServeError", "ServerSettings", "ServerState", "TextFrontend", "check_host", "create_app",
           "make_server"]
