"""`continue_final_message`: a final assistant message is continued from its text as written. Its
text parts are appended as they are, as llama.cpp's server does (`chat_params.prompt += p.text` for
each part of the prefilled assistant message); every other message keeps its parts joined by a
newline (`ChatMessage.text`)."""

from __future__ import annotations

from core.config import Settings
from core.infra.tokenizers import tokenizer_for
from core.protocol.schemas import ChatCompletionRequest
from core.protocol.translate import chat_prompt
from core.registry import chat_template_for

MODEL = "smollm2-135m-instruct"


def _prompt(messages: list[dict], **kw) -> str:
    tok = tokenizer_for(MODEL)
    req = ChatCompletionRequest.model_validate({"model": MODEL, "messages": messages, **kw})
    return tok.decode(chat_prompt(req, tok, chat_template_for(MODEL, Settings(), tok)))


def _parts(*texts: str) -> list[dict]:
    return [{"type": "text", "text": t} for t in texts]


def test_a_continued_assistant_message_of_parts_goes_on_from_its_text_as_written():
    user = {"role": "user", "content": _parts("Name a", "fruit")}
    text = _prompt([user, {"role": "assistant", "content": _parts("Wh", "ill")}], continue_final_message=True)
    assert text.endswith("assistant\nWhill"), text[-40:]
    assert "Name a\nfruit" in text  # the user's parts are still joined by a newline
    as_string = _prompt([user, {"role": "assistant", "content": "Whill"}], continue_final_message=True)
    assert text == as_string


def test_an_assistant_message_not_continued_keeps_the_newline_join():
    msgs = [{"role": "assistant", "content": _parts("Wh", "ill")}, {"role": "user", "content": "go on"}]
    assert "Wh\nill" in _prompt(msgs, continue_final_message=True)
    assert "Wh\nill" in _prompt(msgs[:1])
