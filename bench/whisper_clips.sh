#!/usr/bin/env bash
# Re-makes the speech clips of tests/data/whisper/ (clip1.wav ... clip6.wav: 16 kHz, mono, 16-bit
# PCM, 2-4 s each) and clip4_44k_stereo.wav (clip4 at 44.1 kHz, two channels: the resampling case),
# synthesised by espeak-ng and converted by sox. Needs both (Debian: apt-get install espeak-ng sox,
# tested with espeak-ng 1.51 and SoX 14.4.2); the clips are committed, so tests never need them.
# Voices, speed and pitch are fixed and sox never dithers (-D), so a re-make gives the same bytes
# with the same tool versions. After a re-make, re-record the references: bench/whisper_references.py.
#
#     bash bench/whisper_clips.sh
set -euo pipefail
out="$(cd "$(dirname "$0")/.." && pwd)/tests/data/whisper"
mkdir -p "$out"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# name|voice|words per minute|text
clips=(
  "clip1|en-us|175|The quick brown fox jumps over the lazy dog."
  "clip2|en-us|175|Please send the report to Alice before Friday."
  "clip3|en-gb|165|It is raining again, so bring an umbrella."
  "clip4|en-us|150|What time does the next train leave?"
  "clip5|en-us|175|The meeting starts at nine thirty tomorrow morning."
  "clip6|en-gb|180|Seven hundred people visited the museum on Sunday."
)
for clip in "${clips[@]}"; do
  IFS='|' read -r name voice wpm text <<<"$clip"
  espeak-ng -v "$voice" -s "$wpm" -p 50 -a 100 -w "$tmp/$name.wav" "$text"
  sox -D "$tmp/$name.wav" -r 16000 -c 1 -b 16 -e signed-integer "$out/$name.wav"
done
# The right channel at half the left's amplitude: a reader that keeps one channel, instead of
# averaging both as faster-whisper's decode (FFmpeg's resampler) does, is told apart.
sox -D "$out/clip4.wav" -r 44100 -b 16 -e signed-integer "$out/clip4_44k_stereo.wav" remix 1 1v0.5
for f in "$out"/clip*.wav; do
  printf '%s  %s s\n' "$(basename "$f")" "$(soxi -D "$f")"
done
