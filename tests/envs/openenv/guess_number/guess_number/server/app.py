"""The guess-number environment over HTTP and WebSocket (uvicorn guess_number.server.app:app)."""

from openenv.core.env_server.http_server import create_app

from guess_number.models import GuessNumberAction, GuessNumberObservation
from guess_number.server.guess_number_environment import GuessNumberEnvironment

app = create_app(GuessNumberEnvironment, GuessNumberAction, GuessNumberObservation, env_name="guess_number",
                 max_concurrent_envs=64)
