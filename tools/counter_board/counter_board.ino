// counterboard v1: 2-channel 4x quadrature counter, line protocol of docs/encoders.md. Pins need CHANGE
// interrupts (Leonardo/Micro: 0,1,2,3,7; RP2040, ESP32, Due, Teensy: any). Count up when A leads B.
const uint8_t PIN_A[2] = {2, 0}, PIN_B[2] = {3, 1};
const int8_t STEP[16] = {0, -1, 1, 0, 1, 0, 0, -1, -1, 0, 0, 1, 0, 1, -1, 0};  // [old AB][new AB]
volatile int32_t count[2];
volatile uint8_t state[2];
uint32_t period_us = 2000, next_us;  // 500 Hz

uint8_t readAB(uint8_t c) { return (digitalRead(PIN_A[c]) << 1) | digitalRead(PIN_B[c]); }
void decode(uint8_t c) { uint8_t s = readAB(c); count[c] += STEP[(state[c] << 2) | s]; state[c] = s; }
void isr0() { decode(0); }
void isr1() { decode(1); }

void emit(const char *payload) {  // payload*XX\n, XX = hex XOR of the payload bytes
  uint8_t x = 0;
  for (const char *p = payload; *p; ++p) x ^= *p;
  char tail[6];
  snprintf(tail, sizeof tail, "*%02X\n", x);
  Serial.print(payload);
  Serial.print(tail);
}

void setup() {
  Serial.begin(115200);
  while (!Serial) {}  // native USB boards: wait for the host to open the port
  for (uint8_t c = 0; c < 2; ++c) {
    pinMode(PIN_A[c], INPUT_PULLUP); pinMode(PIN_B[c], INPUT_PULLUP); state[c] = readAB(c);
    attachInterrupt(digitalPinToInterrupt(PIN_A[c]), c ? isr1 : isr0, CHANGE);
    attachInterrupt(digitalPinToInterrupt(PIN_B[c]), c ? isr1 : isr0, CHANGE);
  }
  emit("I counterboard v1 2 ");
  next_us = micros();
}

void loop() {
  if (Serial.available()) {
    char cmd = Serial.read();
    if (cmd == 'R') { long hz = Serial.parseInt(); if (hz >= 1 && hz <= 1000) period_us = 1000000UL / hz; }
    else if (cmd == 'Z') { noInterrupts(); count[0] = count[1] = 0; interrupts(); }
    else if (cmd == '?') emit("I counterboard v1 2 ");
  }
  if ((int32_t)(micros() - next_us) < 0) return;
  next_us += period_us;
  noInterrupts();  // latch both counters and the time together
  int32_t c0 = count[0], c1 = count[1];
  uint32_t t = micros();
  interrupts();
  char line[40];
  snprintf(line, sizeof line, "E 0 %ld %lu ", (long)c0, (unsigned long)t); emit(line);
  snprintf(line, sizeof line, "E 1 %ld %lu ", (long)c1, (unsigned long)t); emit(line);
}
