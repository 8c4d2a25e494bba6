"""The bare reference for ``bench/telegram_bench.py``: python-telegram-bot polling + one model call.

No persistence, no gate, no sessions: every text message becomes exactly one
``AsyncAnthropic.messages.create`` call and the answer goes back with ``reply_text``.

Run: ``python bench/reference_bot.py --api-base-url URL --token T --llm-url URL``
(the API key is read from ``--api-key`` or ``$REFERENCE_API_KEY``). Stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import os
import sys

import anthropic
from telegram import Update
from telegram.ext import Application, ContextTypes, MessageHandler, filters

READY_MARK = "reference bot polling"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--api-base-url", required=True, help="PTB base_url; token appended")
    parser.add_argument("--token", required=True)
    parser.add_argument("--llm-url", required=True, help="Anthropic base_url (the fake)")
    parser.add_argument("--api-key", default=os.environ.get("REFERENCE_API_KEY", "sk-bench"))
    parser.add_argument("--model", default="bench-model")
    parser.add_argument(
        "--concurrent-updates",
        type=int,
        default=8,
        help="PTB concurrent_updates (geodebot's max_concurrent_sessions in the bench); "
        "1 = PTB's default sequential processing",
    )
    parser.add_argument("--poll-timeout", type=float, default=1.0, help="long-poll timeout, s")
    return parser.parse_args(argv)


def build(args: argparse.Namespace) -> Application:  # type: ignore[type-arg]  # PTB's generic Application
    llm = anthropic.AsyncAnthropic(base_url=args.llm_url, api_key=args.api_key, max_retries=0)

    async def answer(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
        message = update.effective_message
        if message is None or message.text is None:
            return
        response = await llm.messages.create(
            model=args.model,
            max_tokens=1024,
            messages=[{"role": "user", "content": message.text}],
        )
        text = "".join(block.text for block in response.content if block.type == "text")
        await message.reply_text(text or "(empty answer)")

    async def ready(app: Application) -> None:  # type: ignore[type-arg]  # PTB's generic Application
        print(READY_MARK, file=sys.stderr, flush=True)

    async def closed(app: Application) -> None:  # type: ignore[type-arg]  # PTB's generic Application
        await llm.close()

    concurrent: bool | int = args.concurrent_updates if args.concurrent_updates > 1 else False
    app = (
        Application.builder()
        .token(args.token)
        .base_url(args.api_base_url)
        .concurrent_updates(concurrent)
        .post_init(ready)
        .post_shutdown(closed)
        .build()
    )
    app.add_handler(MessageHandler(filters.TEXT & ~filters.COMMAND, answer))
    return app


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    app = build(args)
    app.run_polling(
        poll_interval=0.0,
        timeout=int(args.poll_timeout),
        allowed_updates=Update.ALL_TYPES,
        close_loop=True,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
