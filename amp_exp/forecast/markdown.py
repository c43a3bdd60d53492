"""forecast.md: the forecast in words; forecast.json holds the numbers."""

from __future__ import annotations

from typing import Any


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def _step(value: float | None) -> str:
    return "beyond the plan" if value is None else f"{value:,.0f}"


def crossing_sentence(forecast: dict[str, Any]) -> str:
    """One sentence: the first limit crossed and when, or that none is forecast."""
    first = forecast["first_crossing"]
    planned = f"{forecast['planned_steps']:,}"
    if first is None:
        unforecastable = forecast["unforecastable"]
        caveat = (
            f"; unforecastable (too few log points): {', '.join(unforecastable)}"
            if unforecastable
            else ""
        )
        return f"No signal is forecast to cross its limit by step {planned}{caveat}."
    low, high = first["interval"]
    where = f"{first['signal']}" + (f" of {first['module']}" if first["module"] else "")
    if first.get("observed"):
        return (
            f"{where} already crossed its limit ({first['limit']}, "
            f"{_number(first['limit_value'])}) at step {_step(first['step'])} of this run."
        )
    form = first["decided_by"]
    return (
        f"{where} is forecast to cross its limit ({first['limit']}, "
        f"{_number(first['limit_value'])}) at step {_step(first['step'])} "
        f"(interval {_step(low)} to {_step(high)}) of a planned {planned}; the step is the "
        f"{form['shape']}'s in {form['space']} space over the {form['axis']} axis."
    )


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
        "",
        "| signal | module | points | fit from step | slope | residual sd | forecast at end "
        "| interval | limit | crossing |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for signal in forecast["signals"]:
        limit = signal["limit"]
        limit_text = "-" if limit is None else f"{limit['name']} {_number(limit['value'])}"
        if signal["status"] != "fitted":
            lines.append(
                f"| {signal['signal']} | {signal['module'] or '-'} | {signal['points']} "
                f"| unforecastable: {signal['reason']} | | | | | {limit_text} | |"
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
            f"| {limit_text} | {crossing_text} |"
        )
    return "\n".join(lines) + "\n"
