package idempotency

import (
	"fmt"
	"unicode/utf8"
)

// MaxKeyLen is the longest valid idempotency key, in bytes.
const MaxKeyLen = 255

// ValidateKey reports whether key is a valid idempotency key: 1 to
// [MaxKeyLen] characters, each printable ASCII (0x21 to 0x7E). A UUID is a
// good key. The error is [ErrInvalidKey] with the reason; the transports add
// where the key came from (a metadata key, a request field, a message ID).
func ValidateKey(key string) error {
	if key == "" {
		return ErrInvalidKey.with("key is empty", nil)
	}
	if len(key) > MaxKeyLen {
		return ErrInvalidKey.with(fmt.Sprintf("key is %d bytes long, the limit is %d", len(key), MaxKeyLen), nil)
	}
	for i := 0; i < len(key); i++ {
		if c := key[i]; c < 0x21 || c > 0x7e {
			return ErrInvalidKey.with(fmt.Sprintf("byte %d is %s; only printable ASCII 0x21-0x7E is allowed", i, describeByte(key, i)), nil)
		}
	}
	return nil
}

// invalidKey is ErrInvalidKey about field, the place the key came from.
func invalidKey(field, detail string) error {
	return ErrInvalidKey.with(detail, nil).about(field)
}

// keyError re-labels an error of [ValidateKey] with where the key came from:
// field names it for BadRequest, and the message starts with what.
func keyError(err error, field, what string) error {
	e, ok := err.(*Error)
	if !ok {
		return err
	}
	e = e.about(field)
	if what != "" {
		e.detail = what + ": " + e.detail
	}
	return e
}

func describeByte(s string, i int) string {
	if r, _ := utf8.DecodeRuneInString(s[i:]); r != utf8.RuneError && r >= 0x80 {
		return fmt.Sprintf("non-ASCII %q", r)
	}
	return fmt.Sprintf("0x%02X", s[i])
}
