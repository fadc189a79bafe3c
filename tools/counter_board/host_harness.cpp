// Host-side check of counter_board.ino (no board needed): the Arduino calls the sketch uses, and
// quadrature edges fed to its interrupts.  Used by tests/test_encoders.py:
//   g++ -std=c++17 -I tools/counter_board -o harness tools/counter_board/host_harness.cpp
//   ./harness START_MICROS STEPS_CH0 STEPS_CH1   (prints the sketch's serial output for 2 s)
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#define INPUT_PULLUP 2
#define CHANGE 1
static uint8_t pins[8];
static uint32_t now_us;
static void (*isr_of[8])();
int digitalRead(uint8_t p) { return pins[p]; }
void pinMode(uint8_t, uint8_t) {}
uint8_t digitalPinToInterrupt(uint8_t p) { return p; }
void attachInterrupt(uint8_t i, void (*f)(), int) { isr_of[i] = f; }
uint32_t micros() { return now_us; }
void noInterrupts() {}
void interrupts() {}
struct SerialPort {
  std::string in;
  size_t pos = 0;
  void begin(long) {}
  explicit operator bool() const { return true; }
  int available() { return pos < in.size(); }
  int read() { return in[pos++]; }
  long parseInt() {
    while (pos < in.size() && (in[pos] < '0' || in[pos] > '9')) ++pos;
    long v = 0;
    while (pos < in.size() && in[pos] >= '0' && in[pos] <= '9') v = 10 * v + (in[pos++] - '0');
    return v;
  }
  void print(const char *s) { fputs(s, stdout); }
} Serial;
#include "counter_board.ino"

static void set_pin(uint8_t p, uint8_t v) { if (pins[p] != v) { pins[p] = v; isr_of[p](); } }
// one quadrature step of channel c in direction dir (+1: A leads B)
static void step(uint8_t c, int dir, uint8_t &phase) {
  static const uint8_t SEQ[4][2] = {{0, 0}, {1, 0}, {1, 1}, {0, 1}};  // (A, B), A leading B
  phase = (phase + (dir > 0 ? 1 : 3)) % 4;
  set_pin(PIN_A[c], SEQ[phase][0]);
  set_pin(PIN_B[c], SEQ[phase][1]);
}

int main(int, char **argv) {
  now_us = strtoul(argv[1], nullptr, 10);  // start time (µs), near 2^32 to test the wrap
  long n0 = atol(argv[2]), n1 = atol(argv[3]);  // steps of channel 0 (forward), channel 1 (backward)
  Serial.in = "R 1000\n?\n";
  setup();
  uint8_t ph0 = 0, ph1 = 0;
  long done0 = 0, done1 = 0;
  for (uint32_t k = 0; k < 200000; ++k) {  // 2 s in 10 µs ticks
    now_us += 10;
    if (k % 3 == 0 && done0 < n0) { step(0, +1, ph0); ++done0; }
    if (k % 7 == 0 && done1 < n1) { step(1, -1, ph1); ++done1; }
    loop();
  }
  return 0;
}
