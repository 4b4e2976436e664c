"""The dashboard's text is readable: every text colour its stylesheet sets has a
contrast ratio of at least 4.5:1 (WCAG 2 AA, normal text) against each background it
is drawn on. The colours are read from the stylesheet the package serves, so a colour
changed there is what is checked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import fleetwave.api

CSS = (Path(fleetwave.api.__file__).parent / "static" / "app.css").read_text(encoding="utf-8")
AA = 4.5


def _rule(selector: str) -> dict[str, str]:
    """The declarations of the rule whose selector list is exactly ``selector``."""
    found = re.search(r"(?:^|\})\s*" + re.escape(selector) + r"\s*\{([^}]*)\}", CSS, re.M)
    assert found is not None, f"no rule {selector!r} in app.css"
    return {
        k.strip(): v.strip()
        for k, v in (d.split(":", 1) for d in found.group(1).split(";") if ":" in d)
    }


ROOT = _rule(":root")


def _colour(value: str) -> str:
    """A colour as ``#rrggbb``: a variable of :root resolved, #fff widened."""
    var = re.fullmatch(r"var\((--[a-z-]+)\)", value)
    if var:
        value = ROOT[var.group(1)]
    if re.fullmatch(r"#[0-9a-fA-F]{3}", value):
        value = "#" + "".join(c * 2 for c in value[1:])
    assert re.fullmatch(r"#[0-9a-fA-F]{6}", value), value
    return value.lower()


def _luminance(hex_colour: str) -> float:
    def channel(c: int) -> float:
        s = c / 255
        return s / 12.92 if s <= 0.04045 else ((s + 0.055) / 1.055) ** 2.4

    r, g, b = (int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))
    return 0.2126 * channel(r) + 0.7152 * channel(g) + 0.0722 * channel(b)


def contrast(a: str, b: str) -> float:
    la, lb = sorted((_luminance(_colour(a)), _luminance(_colour(b))), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def test_the_contrast_ratio_is_computed_as_wcag_says() -> None:
    assert contrast("#000000", "#ffffff") == pytest.approx(21.0)
    assert contrast("#777777", "#ffffff") == pytest.approx(4.48, abs=0.01)  # (just under)


TEXT_ON_PAGE = ["--fg", "--muted", "--link", "--bad", "--ok"]


@pytest.mark.parametrize("text", TEXT_ON_PAGE)
@pytest.mark.parametrize("background", ["--bg", "--panel"])
def test_text_colours_are_readable_on_the_page(text: str, background: str) -> None:
    ratio = contrast(ROOT[text], ROOT[background])
    assert ratio >= AA, f"{text} on {background}: {ratio:.2f}:1"


@pytest.mark.parametrize(
    "selector", ["button", "button.primary", "button.danger", ".skip:focus", ".tip"]
)
def test_buttons_text_is_readable_on_their_own_background(selector: str) -> None:
    rule = _rule(selector)
    text = rule.get("color", "var(--fg)")
    ratio = contrast(text, rule["background"])
    assert ratio >= AA, f"{selector}: {ratio:.2f}:1"


@pytest.mark.parametrize(
    "selector",
    [
        ".badge.s-complete",
        ".badge.s-failed",
        ".badge.s-aborted, .badge.s-aborting",
        ".badge.s-applying",
        ".badge.s-paused, .badge.s-waiting-approval",
    ],
)
def test_state_badges_keep_the_text_readable(selector: str) -> None:
    ratio = contrast("var(--fg)", _rule(selector)["background"])
    assert ratio >= AA, f"{selector}: {ratio:.2f}:1"
