package idempotency

import (
	"bytes"
	"cmp"
	"crypto/sha256"
	"encoding/binary"
	"hash"
	"math"
	"slices"
	"strings"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"
)

// isJSONType reports whether a body of mediaType (lower case, as
// mime.ParseMediaType returns it) is compared as JSON: application/json
// and the structured suffix +json (RFC 6839: application/problem+json,
// application/merge-patch+json, vendor types).
func isJSONType(mediaType string) bool {
	return mediaType == "application/json" || (strings.HasSuffix(mediaType, "+json") && strings.Contains(mediaType, "/"))
}

// jsonDigest returns the SHA-256 of body's canonical form, and false when
// body is not one JSON value (RFC 8259) that the canonical form holds:
// then the body is compared by its bytes.
//
// The canonical form is not RFC 8785 (JCS): JCS writes every number as the
// float64 it rounds to, so 1 and 1.0 would be one request, and so would two
// integers past 2^53 that differ (an amount, an id), while a Go handler
// decoding into an int64 or a json.Number tells them apart (and refuses
// 1.0). Only what a handler decoding the body into values (encoding/json,
// protojson) cannot see is dropped:
//
//   - whitespace between tokens;
//   - the order of an object's members: they are sorted by key (by its
//     canonical text case folded, as encoding/json matches a key to a
//     field), and members whose keys fold alike keep the order they were
//     sent in, so {"a":1,"a":2} (which encoding/json reads as 2) is never
//     {"a":2,"a":1} (read as 1), nor {"a":2};
//   - how a string is escaped: it counts as the text it decodes to, so
//     "\u00e9", "\u00E9" and "é" are one string, and "\/" is "/".
//
// A number counts as its literal, as sent: 1, 1.0, 1e0 and -0 against 0
// are different requests, however large. A key counts as spelled ("Amount"
// is not "amount", though encoding/json matches struct fields either way).
// A string holding bytes that are not UTF-8, or an escaped surrogate that
// is not half of a pair, makes the body not canonical (encoding/json would
// read each as U+FFFD, so that two different bodies would be one request),
// and so does nesting deeper than maxJSONDepth (encoding/json refuses it),
// or anything before or after the one value but whitespace (a byte order
// mark, a second value).
//
// The cost is bounded by the body's size: every byte is read once; the
// canonical text is written into a buffer of the body's length (it is never
// longer than the body), where a closed object or array longer than
// jsonInline bytes is replaced by its SHA-256 (so sorting a level moves
// only what that level holds: no byte is copied again for every level it
// is nested in); each member of an open object is held as five offsets
// and the head of its folded key (32 bytes, against the 5 bytes or more
// the member takes in the body); and each key is case folded once, when it
// is read, into a text no longer than the key, which the sort compares as
// bytes, most comparisons by its head alone (comparing the keys' runes
// folded at each comparison cost seconds for a body of keys that share a
// long prefix). The sort is not a stable sort in place, whose moves cost
// twice the rest for an object of many members sent in no order.
func jsonDigest(body []byte) (sum [sha256.Size]byte, ok bool) {
	if len(body) == 0 || len(body) > math.MaxUint32 {
		return sum, false
	}
	c := jsonCanon{in: body, out: make([]byte, 0, len(body))}
	if !c.run() {
		return sum, false
	}
	return sha256.Sum256(c.out), true
}

// The shape of the canonical text, of which jsonDigest returns the hash:
// JSON without whitespace, objects' members sorted, strings escaped one
// way (only '"', '\\' and the control characters: \b \f \n \r \t, others
// as \u00xx in lower case), numbers and literals as sent; but an object or
// array whose text is over jsonInline bytes is written as a zero byte (no
// JSON text holds one) and the 32 bytes of its text's SHA-256.
const (
	jsonInline   = 32
	maxJSONDepth = 10000 // encoding/json's own limit
	jsonDigested = 0
)

// jsonCanon is the state of one canonicalisation.
type jsonCanon struct {
	in      []byte
	pos     int
	out     []byte       // the canonical text of what was read, containers closed or open
	frames  []jsonFrame  // the open containers, innermost last
	members []jsonMember // the members of the open objects, in the order read
	folds   []byte       // their keys case folded (see foldKey), in the same order
	h       hash.Hash
	sum     [sha256.Size]byte // h's output, here so that it is not allocated per container
	folded  int               // bytes of keys case folded: the body's size bounds them
}

// jsonFrame is an open object or array.
type jsonFrame struct {
	start   uint32 // its '{' or '[' in out
	members uint32 // an object's first member in members
	folds   uint32 // and its key's fold in folds
	object  bool
}

// jsonMember is an object's member in out: its key (quoted) in from:value,
// its value in value:to; its key case folded in folds, fold:folded, the
// first bytes of which are head. Its
// ':' and ',' are not written until the object is closed and its members
// sorted.
type jsonMember struct {
	from, value, to uint32
	fold, folded    uint32
	head            uint64
}

// foldHead is the first 8 bytes of a folded key after its quote, as a
// number that compares as they do (shorter keys padded with zero bytes,
// which no key's text holds): most comparisons of a sort end on it.
func foldHead(fold []byte) uint64 {
	var b [8]byte
	copy(b[:], fold[1:])
	return binary.BigEndian.Uint64(b[:])
}

// run reads one JSON value and nothing else but whitespace.
func (c *jsonCanon) run() bool {
values:
	for {
		c.space()
		opened, ok := c.value()
		if !ok {
			return false
		}
		if opened {
			continue
		}
		for {
			c.space()
			if len(c.frames) == 0 {
				return c.pos == len(c.in)
			}
			if c.pos == len(c.in) {
				return false
			}
			f := &c.frames[len(c.frames)-1]
			if f.object {
				c.members[len(c.members)-1].to = uint32(len(c.out))
			}
			switch ch := c.in[c.pos]; {
			case ch == ',':
				c.pos++
				if f.object {
					if !c.key() {
						return false
					}
				} else {
					c.out = append(c.out, ',')
				}
				continue values
			case f.object && ch == '}', !f.object && ch == ']':
				c.pos++
				c.close()
			default:
				return false
			}
		}
	}
}

// space skips insignificant whitespace.
func (c *jsonCanon) space() {
	for c.pos < len(c.in) {
		switch c.in[c.pos] {
		case ' ', '\t', '\n', '\r':
			c.pos++
		default:
			return
		}
	}
}

// value reads a scalar whole, or opens an object or array, reading an
// object's first key: opened says that a value is to be read next.
func (c *jsonCanon) value() (opened, ok bool) {
	if c.pos == len(c.in) {
		return false, false
	}
	switch c.in[c.pos] {
	case '{', '[':
		if len(c.frames) == maxJSONDepth {
			return false, false // an empty one counts too, as for encoding/json
		}
		open := c.in[c.pos]
		object := open == '{'
		c.pos++
		c.space()
		if c.pos < len(c.in) && c.in[c.pos] == open+2 { // '}' or ']', empty
			c.pos++
			c.out = append(c.out, open, open+2)
			return false, true
		}
		c.frames = append(doubled(c.frames, 1), jsonFrame{start: uint32(len(c.out)), members: uint32(len(c.members)), folds: uint32(len(c.folds)), object: object})
		if object {
			c.out = append(c.out, '{')
			return true, c.key()
		}
		c.out = append(c.out, '[')
		return true, true
	case '"':
		return false, c.str()
	case 't':
		return false, c.literal("true")
	case 'f':
		return false, c.literal("false")
	case 'n':
		return false, c.literal("null")
	}
	return false, c.number()
}

// key reads an object's member up to its value: its key and the colon.
func (c *jsonCanon) key() bool {
	c.space()
	if c.pos == len(c.in) || c.in[c.pos] != '"' {
		return false
	}
	from := uint32(len(c.out))
	if !c.str() {
		return false
	}
	c.space()
	if c.pos == len(c.in) || c.in[c.pos] != ':' {
		return false
	}
	c.pos++
	fold := uint32(len(c.folds))
	c.folds = foldKey(doubled(c.folds, int(uint32(len(c.out))-from)), c.out[from:])
	c.folded += len(c.out) - int(from)
	c.members = append(doubled(c.members, 1), jsonMember{from: from, value: uint32(len(c.out)), fold: fold, folded: uint32(len(c.folds)),
		head: foldHead(c.folds[fold:])})
	return true
}

// doubled returns s with room for n more elements: when short, copied
// into twice what it needs, not grown by a quarter as append grows a large
// slice, so that what is allocated in all stays under twice what is held.
func doubled[E any](s []E, n int) []E {
	if len(s)+n <= cap(s) {
		return s
	}
	grown := make([]E, len(s), 2*(len(s)+n)+16)
	copy(grown, s)
	return grown
}

// close closes the innermost container: it sorts an object's members, and
// replaces a container's text with its hash when it is over jsonInline
// bytes.
func (c *jsonCanon) close() {
	f := c.frames[len(c.frames)-1]
	c.frames = c.frames[:len(c.frames)-1]
	if !f.object {
		c.out = append(c.out, ']')
		if len(c.out)-int(f.start) > jsonInline {
			c.digest(f.start, c.out[f.start:])
		}
		return
	}
	ms := c.members[f.members:]
	c.members = c.members[:f.members] // ms is read below, before any member is added
	// By key as encoding/json matches keys to a struct's fields: case
	// folded (Unicode's simple folding: "Amount" and "amount", "s" and
	// "ſ"), the last match winning. Members whose keys fold alike keep the
	// order they were sent in, as a handler's decoder reads them;
	// reordering them would be another request. The order they were sent
	// in is where they are in out: a sort with that as the last criterion
	// is stable without a stable sort's cost (which moves each member
	// once per level of its merges, log n levels over).
	slices.SortFunc(ms, func(a, b jsonMember) int {
		if a.head != b.head {
			return cmp.Compare(a.head, b.head)
		}
		if o := bytes.Compare(c.folds[a.fold:a.folded], c.folds[b.fold:b.folded]); o != 0 {
			return o
		}
		return cmp.Compare(a.from, b.from)
	})
	c.folds = c.folds[:f.folds]
	// '{', each member as key ':' value, the commas between them, '}'.
	size := 1 + 2*len(ms)
	for _, m := range ms {
		size += int(m.to - m.from)
	}
	if size > jsonInline {
		c.digest(f.start, nil, ms...)
		return
	}
	var text [jsonInline]byte
	t := append(text[:0], '{')
	for i, m := range ms {
		if i > 0 {
			t = append(t, ',')
		}
		t = append(append(append(t, c.out[m.from:m.value]...), ':'), c.out[m.value:m.to]...)
	}
	t = append(t, '}')
	c.out = append(c.out[:f.start], t...)
}

// digest replaces what out holds from start with the zero byte and the
// SHA-256 of text, or of the object of the members ms.
func (c *jsonCanon) digest(start uint32, text []byte, ms ...jsonMember) {
	if c.h == nil {
		c.h = sha256.New()
	}
	c.h.Reset()
	if ms == nil {
		c.h.Write(text)
	} else {
		c.h.Write(punct[0:1]) // '{'
		for i, m := range ms {
			if i > 0 {
				c.h.Write(punct[3:4]) // ','
			}
			c.h.Write(c.out[m.from:m.value])
			c.h.Write(punct[2:3]) // ':'
			c.h.Write(c.out[m.value:m.to])
		}
		c.h.Write(punct[1:2]) // '}'
	}
	c.out = append(append(c.out[:start], jsonDigested), c.h.Sum(c.sum[:0])...)
}

// punct is the punctuation an object's text is hashed with, written
// from here rather than from a literal that would be allocated per call.
var punct = []byte("{}:,")

// literal reads true, false or null.
func (c *jsonCanon) literal(word string) bool {
	if !bytes.HasPrefix(c.in[c.pos:], []byte(word)) {
		return false
	}
	c.pos += len(word)
	c.out = append(c.out, word...)
	return true
}

// number reads a number (RFC 8259's grammar) and writes it as sent.
func (c *jsonCanon) number() bool {
	start := c.pos
	digits := func() int {
		n := 0
		for c.pos < len(c.in) && c.in[c.pos] >= '0' && c.in[c.pos] <= '9' {
			c.pos++
			n++
		}
		return n
	}
	if c.pos < len(c.in) && c.in[c.pos] == '-' {
		c.pos++
	}
	switch n := digits(); {
	case n == 0, n > 1 && c.in[c.pos-n] == '0':
		return false // no digit, or a leading zero
	}
	if c.pos < len(c.in) && c.in[c.pos] == '.' {
		c.pos++
		if digits() == 0 {
			return false
		}
	}
	if c.pos < len(c.in) && (c.in[c.pos] == 'e' || c.in[c.pos] == 'E') {
		c.pos++
		if c.pos < len(c.in) && (c.in[c.pos] == '+' || c.in[c.pos] == '-') {
			c.pos++
		}
		if digits() == 0 {
			return false
		}
	}
	c.out = append(c.out, c.in[start:c.pos]...)
	return true
}

// plain marks the bytes a string holds as they are: neither the quote, the
// backslash, a control character nor the start of a multi-byte character.
var plain = func() (t [256]bool) {
	for b := 0x20; b < utf8.RuneSelf; b++ {
		t[b] = b != '"' && b != '\\'
	}
	return t
}()

// str reads a string and writes the text it decodes to, escaped one way.
func (c *jsonCanon) str() bool {
	c.pos++ // the opening quote
	c.out = append(c.out, '"')
	for {
		from := c.pos
		for c.pos < len(c.in) && plain[c.in[c.pos]] {
			c.pos++
		}
		c.out = append(c.out, c.in[from:c.pos]...)
		if c.pos == len(c.in) {
			return false
		}
		switch b := c.in[c.pos]; {
		case b == '"':
			c.pos++
			c.out = append(c.out, '"')
			return true
		case b < 0x20:
			return false // a control character must be escaped
		case b >= utf8.RuneSelf:
			r, n := utf8.DecodeRune(c.in[c.pos:])
			if r == utf8.RuneError && n == 1 {
				return false // not UTF-8
			}
			c.out = append(c.out, c.in[c.pos:c.pos+n]...)
			c.pos += n
		default: // '\\'
			r, ok := c.escape()
			if !ok {
				return false
			}
			c.out = appendJSONRune(c.out, r)
		}
	}
}

// escape reads an escape sequence, a surrogate pair as one.
func (c *jsonCanon) escape() (rune, bool) {
	if c.pos+1 >= len(c.in) {
		return 0, false
	}
	e := c.in[c.pos+1]
	c.pos += 2
	switch e {
	case '"', '\\', '/':
		return rune(e), true
	case 'b':
		return '\b', true
	case 'f':
		return '\f', true
	case 'n':
		return '\n', true
	case 'r':
		return '\r', true
	case 't':
		return '\t', true
	case 'u':
		r, ok := c.hex4()
		switch {
		case !ok:
			return 0, false
		case utf16.IsSurrogate(r):
			// Only a high half followed by an escaped low half.
			if r >= 0xdc00 || c.pos+1 >= len(c.in) || c.in[c.pos] != '\\' || c.in[c.pos+1] != 'u' {
				return 0, false
			}
			c.pos += 2
			lo, ok := c.hex4()
			if r = utf16.DecodeRune(r, lo); !ok || r == utf8.RuneError {
				return 0, false
			}
		}
		return r, true
	}
	return 0, false
}

// hex4 reads the four hex digits of a \u escape.
func (c *jsonCanon) hex4() (rune, bool) {
	if c.pos+4 > len(c.in) {
		return 0, false
	}
	var r rune
	for _, b := range c.in[c.pos : c.pos+4] {
		switch {
		case b >= '0' && b <= '9':
			r = r<<4 | rune(b-'0')
		case b >= 'a' && b <= 'f':
			r = r<<4 | rune(b-'a'+10)
		case b >= 'A' && b <= 'F':
			r = r<<4 | rune(b-'A'+10)
		default:
			return 0, false
		}
	}
	c.pos += 4
	return r, true
}

// appendJSONRune writes r into a string's canonical text.
func appendJSONRune(out []byte, r rune) []byte {
	switch r {
	case '"', '\\':
		return append(out, '\\', byte(r))
	case '\b':
		return append(out, '\\', 'b')
	case '\f':
		return append(out, '\\', 'f')
	case '\n':
		return append(out, '\\', 'n')
	case '\r':
		return append(out, '\\', 'r')
	case '\t':
		return append(out, '\\', 't')
	}
	if r < 0x20 {
		const hexDigits = "0123456789abcdef"
		return append(out, '\\', 'u', '0', '0', hexDigits[r>>4], hexDigits[r&0xf])
	}
	return utf8.AppendRune(out, r)
}

// foldKey appends key (a canonical JSON string, UTF-8) case folded as
// encoding/json folds a key: each rune as the smallest rune of its simple
// folding orbit, ASCII letters as upper case. Two folded keys compare as
// bytes as their runes compare (UTF-8 keeps the order of code points), and
// a folded key is never longer than the key: the smallest rune of an orbit
// takes no more bytes than any other.
func foldKey(dst, key []byte) []byte {
	for len(key) > 0 {
		if c := key[0]; c < utf8.RuneSelf {
			if 'a' <= c && c <= 'z' {
				c -= 'a' - 'A'
			}
			dst = append(dst, c)
			key = key[1:]
			continue
		}
		r, n := utf8.DecodeRune(key)
		if r < rune(len(twoByteFolds)) {
			r = rune(twoByteFolds[r])
		} else {
			r = smallestFold(r)
		}
		dst = utf8.AppendRune(dst, r)
		key = key[n:]
	}
	return dst
}

// twoByteFolds holds smallestFold of the runes UTF-8 writes in one or two
// bytes (Latin, Greek, Cyrillic, combining marks): those of the longest
// orbits, such as U+0345's four, are folded without a search.
var twoByteFolds = func() (t [0x800]uint16) {
	for r := range t {
		t[r] = uint16(smallestFold(rune(r)))
	}
	return t
}()

// smallestFold is the smallest rune of r's simple folding orbit.
func smallestFold(r rune) rune {
	for {
		f := unicode.SimpleFold(r)
		if f <= r {
			return f
		}
		r = f
	}
}
