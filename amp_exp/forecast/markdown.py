"""forecast.md: the forecast in words; forecast.json holds the numbers."""

from __future__ import annotations

from typing import Any

# What a chance's interval is, in a sentence.
PLAUSIBLE_WORDS = " over the forms still plausible"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _step(value: float | None) -> str:
    return "beyond the plan" if value is None else f"{value:,.0f}"


def percent(share: float) -> str:
    """A chance as a whole percentage, its far ends as under 1% and over 99%."""
    return "under 1%" if share < 0.005 else "over 99%" if share > 0.995 else f"{share:.0%}"


def _chance(chance: dict[str, Any], words: str = "") -> str:
    """A crossing's chance by the planned end, with its interval (``Fit.chance``); ``words``
    after the interval say what it is, in a sentence."""
    value, (low, high) = percent(chance["value"]), (percent(v) for v in chance["interval"])
    return value if low == high else f"{value} ({low} to {high}{words})"


def crossing_sentence(forecast: dict[str, Any]) -> str:
    """One sentence: the first limit crossed and when, or that none is forecast and the chance
    of the likeliest crossing all the same."""
    first = forecast["first_crossing"]
    planned = f"{forecast['planned_steps']:,}"
    if first is None:
        unforecastable = forecast["unforecastable"]
        caveat = (
            f"; unforecastable (too few log points): {', '.join(unforecastable)}"
            if unforecastable
            else ""
        )
        likeliest = forecast.get("likeliest_crossing")
        chance = (
            ""
            if likeliest is None
            else f" The likeliest to is {where(likeliest)} ({likeliest['limit']}): a chance of "
            f"{_chance(likeliest['chance'], PLAUSIBLE_WORDS)} by the planned end."
        )
        return f"No signal is forecast to cross its limit by step {planned}{caveat}.{chance}"
    low, high = first["interval"]
    subject = where(first)
    if first.get("observed"):
        return (
            f"{subject} already crossed its limit ({first['limit']}, "
            f"{_number(first['limit_value'])}) at step {_step(first['step'])} of this run."
        )
    form = first["decided_by"]
    return (
        f"{subject} is forecast to cross its limit ({first['limit']}, "
        f"{_number(first['limit_value'])}) at step {_step(first['step'])} "
        f"(interval {_step(low)} to {_step(high)}) of a planned {planned}; the step is the "
        f"{form['shape']}'s in {form['space']} space over the {form['axis']} axis; its chance "
        f"by the planned end: {_chance(first['chance'], PLAUSIBLE_WORDS)}."
    )


def where(crossing: dict[str, Any]) -> str:
    """A crossing's signal, and its module where it has one."""
    return f"{crossing['signal']}" + (f" of {crossing['module']}" if crossing["module"] else "")


def forecast_markdown(run: str, forecast: dict[str, Any]) -> str:
    lines = [
        f"# Forecast of {run} to {forecast['planned_steps']:,} steps",
        "",
        crossing_sentence(forecast),
        "",
        f"- Observed: {forecast['observed_steps']:,} steps. The planned run is {forecast['plan']}.",
        f"- Time axis of the fits: {forecast['axis']}.",
        f"- Forecast intervals: {forecast['level']:.0%} prediction intervals, the hull over "
        "every growth form the points leave plausible (line, power law, quadratic; in the "
        "signal's own and in log space; over each time axis). A crossing is claimed only where "
        "the signal's trend "
        f"heads to its limit at a family-wise {forecast['familywise_alpha']:.0%} level "
        "(Holm's step-down over the limited signals). The crossing is the first logged value past "
        "the limit (for the loss scale, its read at a log step): from the trend and the "
        "values' spread about it, the step where that is as likely as not; its interval, "
        "the same hull of each form's, covers it at "
        f"{1 - forecast['familywise_alpha']:.0%} or more if one of the forms holds; 'beyond "
        "the plan' as its end means a form that slows enough not to cross by the planned end "
        "is still plausible.",
        "- Chance by the end: the chance that the planned run logs a value past the limit by "
        "its last step, from the deciding trend and the values' spread about it (about one half "
        "or more where a named crossing's step is within the plan), and in brackets the "
        "interval the true chance lies in, at the crossings' level: the hull over the same "
        "forms, each with its band and the spread's own interval; for every limited signal, "
        "named crossing or not.",
        "",
        "| signal | module | points | fit from step | slope | residual sd | forecast at end "
        "| interval | limit | crossing | chance by the end |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for signal in forecast["signals"]:
        limit = signal["limit"]
        limit_text = "-" if limit is None else f"{limit['name']} {_number(limit['value'])}"
        if signal["status"] != "fitted":
            lines.append(
                f"| {signal['signal']} | {signal['module'] or '-'} | {signal['points']} "
                f"| unforecastable: {signal['reason']} | | | | | {limit_text} | | |"
            )
            continue
        end = signal["forecast"]
        crossing = signal["crossing"]
        crossing_text = "-" if crossing is None else f"step {_step(crossing['step'])}"
        if crossing is not None and crossing.get("observed"):
            crossing_text += " (observed)"
        lines.append(
            f"| {signal['signal']} | {signal['module'] or '-'} | {signal['points']} "
            f"| {signal['fit_from_step']:.0f} "
            f"| {'; '.join(f'{v:.3g} per {axis}' for axis, v in signal['slope'].items())} "
            f"({signal['space']}) "
            f"| {signal['residual_sd']:.3g} | {_number(end['value'])} "
            f"| {_number(end['interval'][0])} to {_number(end['interval'][1])} "
            f"| {limit_text} | {crossing_text} "
            f"| {'-' if signal.get('chance') is None else _chance(signal['chance'])} |"
        )
    return "\n".join(lines) + "\n"
