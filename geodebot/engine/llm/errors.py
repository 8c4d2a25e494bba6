"""Classified LLM errors.

SDK exceptions are mapped once, in each adapter, into this tree::

    LLMError
    ├── TransientLLMError          retried with backoff, then the fallback chain
    │   ├── LLMConnectionError     connection refused / reset / DNS
    │   ├── LLMTimeoutError        request timed out
    │   ├── LLMRateLimited         429 (and 529 overloaded); carries Retry-After
    │   └── LLMServerError         5xx
    └── TerminalLLMError           the turn ends with a readable stop reason
        ├── LLMAuthError           401 / 403, bad key
        ├── LLMMissingCredential   the configured key is not set at all
        ├── LLMBadRequest          400 / 404 / 422 that is not one of the below
        ├── LLMBillingError        402, insufficient credit or quota
        ├── LLMContextOverflow     the prompt is longer than the model's context
        └── LLMInvalidResponse     the provider answered something we cannot use

Every error carries ``user_message``: one sentence safe to show a chat user (no secrets, no
stack traces).
"""

from __future__ import annotations


class LLMError(Exception):
    transient: bool = False

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        provider: str = "",
        model: str = "",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.provider = provider
        self.model = model

    @property
    def kind(self) -> str:
        return type(self).__name__

    @property
    def user_message(self) -> str:
        return f"The model call failed: {self}"


class TransientLLMError(LLMError):
    transient = True

    @property
    def user_message(self) -> str:
        return f"The model provider is unavailable right now ({self}). Please try again later."


class LLMConnectionError(TransientLLMError):
    pass


class LLMTimeoutError(TransientLLMError):
    pass


class LLMRateLimited(TransientLLMError):
    def __init__(
        self,
        message: str,
        *,
        retry_after: float | None = None,
        status: int | None = 429,
        provider: str = "",
        model: str = "",
    ) -> None:
        super().__init__(message, status=status, provider=provider, model=model)
        self.retry_after = retry_after


class LLMServerError(TransientLLMError):
    pass


class TerminalLLMError(LLMError):
    pass


class LLMAuthError(TerminalLLMError):
    @property
    def user_message(self) -> str:
        return f"The model provider rejected the API key ({self})."


class LLMMissingCredential(TerminalLLMError):
    def __init__(self, env_name: str, *, provider: str = "", model: str = "") -> None:
        super().__init__(
            f"no API key: set the environment variable {env_name} "
            f"(or the systemd credential {env_name})",
            provider=provider,
            model=model,
        )
        self.env_name = env_name

    @property
    def user_message(self) -> str:
        return f"The model is not configured: {self}."


class LLMBadRequest(TerminalLLMError):
    pass


class LLMBillingError(TerminalLLMError):
    @property
    def user_message(self) -> str:
        return f"The model provider refused the request for billing reasons ({self})."


class LLMContextOverflow(TerminalLLMError):
    @property
    def user_message(self) -> str:
        return "The conversation is too long for the model's context window."


class LLMInvalidResponse(TerminalLLMError):
    @property
    def user_message(self) -> str:
        return f"The model returned a response geodebot could not use ({self})."
