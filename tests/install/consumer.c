/* A program that uses lwo as an installed package: built by run.sh once with
 * find_package(lwo 0.5) (find_package/CMakeLists.txt) and once with
 * pkg-config. It needs no GPU: it checks that the liblwo it runs with is the
 * version of the lwo.h it was compiled with, and calls into the library. */
#include <stdio.h>
#include <string.h>

#include <lwo.h>

int main(void) {
  unsigned v = lwo_version();
  const char* ok = lwo_status_string(LWO_OK);
  printf("lwo_version() = %u (%u.%u.%u), LWO_VERSION = %u\n", v, v / 10000, v / 100 % 100,
         v % 100, (unsigned)LWO_VERSION);
  if (v != LWO_VERSION) {
    fprintf(stderr, "consumer: liblwo is version %u but lwo.h is %u\n", v, (unsigned)LWO_VERSION);
    return 1;
  }
  printf("lwo_status_string(LWO_OK) = %s\n", ok ? ok : "(null)");
  if (ok == NULL || strcmp(ok, "LWO_OK") != 0) {
    fprintf(stderr, "consumer: lwo_status_string(LWO_OK) is not \"LWO_OK\"\n");
    return 1;
  }
  return 0;
}
