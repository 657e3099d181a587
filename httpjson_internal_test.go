package idempotency

import (
	"bytes"
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"reflect"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"
)

// canonicalText runs the canonicalisation and returns its text, and
// whether the output buffer kept the body's length as its capacity (the
// text is never longer than the body).
func canonicalText(body []byte) (text []byte, ok, inPlace bool) {
	if len(body) == 0 {
		return nil, false, true
	}
	c := jsonCanon{in: body, out: make([]byte, 0, len(body))}
	ok = c.run()
	return c.out, ok, cap(c.out) == len(body)
}

// The canonical form drops what no decoder sees (whitespace, the order of
// keys, the escaping of a string) and keeps the rest: a number's literal,
// duplicate keys in their order, a key's spelling. Bodies that are not one
// JSON value, or that hold what encoding/json would read as U+FFFD, are
// not canonical (the fingerprint falls back to their bytes).
func TestJSONDigestSameAndDifferent(t *testing.T) {
	t.Parallel()
	same := [][2]string{
		{`{"a":1,"b":[true,false,null]}`, ` { "b" : [ true , false , null ] , "a" : 1 } ` + "\n"},
		{`{"a":1,"b":2}`, "{\"a\":1,\r\n\t\"b\":2}"},
		{`{"amount_cents":"100","account_id":"acct-7"}`, `{"account_id":"acct-7", "amount_cents":"100"}`}, // protojson's random space
		{`"é"`, `"\u00e9"`},
		{`"é"`, `"\u00E9"`},
		{`"/"`, `"\/"`},
		{`"😀"`, `"\ud83d\ude00"`},
		{`"\n"`, `"\u000a"`},
		{`"\u001f"`, `"\u001F"`},
		{`"\""`, `"\u0022"`},
		{`{"é":1,"e":2}`, `{"e":2,"\u00e9":1}`},
		{`{"a":{"y":1,"x":[1,{"q":2,"p":3}]}}`, `{"a":{"x":[1,{"p":3,"q":2}],"y":1}}`},
		{`{"a":1,"a":2,"b":0}`, `{"b":0,"a":1,"a":2}`},
		{`[]`, `[ ]`},
		{`{}`, `{ }`},
		{`1e999999999`, ` 1e999999999 `},
		{`{"k":"` + strings.Repeat("x", 100) + `","j":1}`, `{"j":1,"k":"` + strings.Repeat("x", 100) + `"}`},
	}
	for _, c := range same {
		a, aok := jsonDigest([]byte(c[0]))
		b, bok := jsonDigest([]byte(c[1]))
		require.True(t, aok && bok, "%s / %s: both canonical", c[0], c[1])
		require.Equal(t, a, b, "%s and %s are one request", c[0], c[1])
	}
	different := [][2]string{
		{`1`, `1.0`},
		{`1`, `1e0`},
		{`0`, `-0`},
		{`1e2`, `1E2`},
		{`100`, `1e2`},
		{`9007199254740993`, `9007199254740992`}, // one float64, two int64s
		{`{"a":1,"a":2}`, `{"a":2,"a":1}`},
		{`{"a":1,"a":2}`, `{"a":2}`},
		{`{"Amount":1}`, `{"amount":1}`},
		{`["a","b"]`, `["b","a"]`},
		{`{"a":[1,2]}`, `{"a":[2,1]}`},
		{`"a"`, `["a"]`},
		{`{"a":"b"}`, `{"a":["b"]}`},
		{`null`, `"null"`},
		{`{"a":1}`, `{"a":"1"}`},
		{`"\u0000"`, `""`},
		{`[{"a":1},{"b":2}]`, `[{"a":1,"b":2}]`},
		{`{"ab":1}`, `{"a":1,"b":1}`},
	}
	for _, c := range different {
		a, aok := jsonDigest([]byte(c[0]))
		b, bok := jsonDigest([]byte(c[1]))
		require.True(t, aok && bok, "%s / %s: both canonical", c[0], c[1])
		require.NotEqual(t, a, b, "%s and %s are two requests", c[0], c[1])
	}
	for _, body := range []string{
		``, ` `, `{`, `}`, `{"a":1,}`, `[1,]`, `{"a" 1}`, `{a:1}`, `01`, `1.`, `.1`, `-`, `1e`, `+1`,
		`tru`, `nul`, `"abc`, "\"a\x01\"", `"\x"`, `"\u12"`, `"\u12g4"`,
		`1 2`, `{} {}`, `{"a":1}x`, "\xef\xbb\xbf{}", // a byte order mark
		"\"\xff\"", "\"\xed\xa0\x80\"", // not UTF-8; a surrogate in UTF-8
		`"\ud800"`, `"\udc00"`, `"\ud800\u0041"`, `"\ud800x"`, `"\udc00\ud800"`,
		strings.Repeat("[", maxJSONDepth+1) + strings.Repeat("]", maxJSONDepth+1),
	} {
		_, ok := jsonDigest([]byte(body))
		require.False(t, ok, "%.80q is not canonical", body)
	}
	deepest := strings.Repeat(`{"a":[`, maxJSONDepth/2-1) + `{"a":[]}` + strings.Repeat("]}", maxJSONDepth/2-1)
	require.True(t, json.Valid([]byte(deepest)), "sanity: encoding/json reads it")
	_, ok := jsonDigest([]byte(deepest))
	require.True(t, ok, "nesting as deep as encoding/json reads is canonical")
	tooDeep := "[" + deepest + "]"
	require.False(t, json.Valid([]byte(tooDeep)), "sanity: encoding/json refuses it")
	_, ok = jsonDigest([]byte(tooDeep))
	require.False(t, ok, "nesting deeper than encoding/json reads is compared by its bytes")
}

// It failed when the sort of an object's members case folded both keys
// again at each comparison: 500 keys sharing a prefix of 1,000 U+0345
// (which folds in four steps), in descending order, under the default
// 1 MiB limit, cost seconds. Each key is folded once, so the folding
// costs no more than the body's size, whatever its shape.
func TestJSONCanonicalFormFoldsEachKeyOnce(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name string
		body []byte
	}{
		{"keys sharing a prefix of U+0345", sharedPrefixKeys("\u0345", 1000, 500)},
		{"keys sharing a prefix of 'k'", sharedPrefixKeys("k", 2000, 500)},
		{"keys sharing an escaped prefix", sharedPrefixKeys(`\u0345`, 1000, 150)},
		{"many tiny members", []byte(`{` + strings.Repeat(`"a":0,`, 100_000) + `"b":0}`)},
		{"nested objects", []byte(strings.Repeat(`{"b":0,"a":`, 5000) + "0" + strings.Repeat("}", 5000))},
	} {
		canon := jsonCanon{in: c.body, out: make([]byte, 0, len(c.body))}
		require.True(t, canon.run(), c.name)
		require.LessOrEqual(t, canon.folded, len(c.body), "%s: bytes of keys case folded, against the body's %d", c.name, len(c.body))
	}
}

// Keys are ordered as the release before ordered them, folding each pair
// of keys' runes at each comparison (compareRunesFolded, kept here): so a
// body's canonical digest is the one it had, and a stored row compares
// across the upgrade.
func TestJSONFoldedKeysOrderAsBefore(t *testing.T) {
	t.Parallel()
	keys := []string{`""`, `"a"`, `"A"`, `"_"`, `"b"`, `"aa"`, `"a\""`, `"a\\"`, `"ſ"`, `"s"`, `"S"`, `"K"`, `"k"`,
		`"K"`, `"ͅ"`, `"ι"`, `"Ι"`, `"ι"`, `"é"`, `"É"`, `"éx"`, `"😀"`, `"ǅ"`, `"ǆ"`, `"Ǆ"`, `"ẞ"`, `"ß"`, `"\u0000"`, "\"\ufffd\""}
	for _, x := range keys {
		for _, y := range keys {
			want := compareRunesFolded([]byte(x), []byte(y))
			got := bytes.Compare(foldKey(nil, []byte(x)), foldKey(nil, []byte(y)))
			require.Equal(t, want, got, "%s against %s", x, y)
		}
		require.LessOrEqual(t, len(foldKey(nil, []byte(x))), len(x), "%s: its fold is no longer", x)
	}
	body := `{"b":1,"_":2,"A":3,"a":4,"ſ":5,"S":6,"s":7,"K":8,"k":9,"ͅ":10,"ι":11,"Ι":12,"é":13,"É":14,"\u00e9x":15,"":16,"a\"":17,"a\\":18,"aa":19,"😀":20,"z":{"Y":1,"y":2,"x":[{"q":1,"Q":2}]}}`
	d, ok := jsonDigest([]byte(body))
	require.True(t, ok)
	require.Equal(t, "bdc5f5bcb3fe206c873b7604c23b6f8d261d077c0299278fc4645fdcca3d159f", hex.EncodeToString(d[:]), "the digest the release before computed")
}

// compareRunesFolded is how the release before ordered two keys: rune by
// rune, each folded to the smallest rune of its orbit (ASCII letters upper
// case), then the shorter first.
func compareRunesFolded(x, y []byte) int {
	for len(x) > 0 && len(y) > 0 {
		rx, nx := utf8.DecodeRune(x)
		ry, ny := utf8.DecodeRune(y)
		if rx, ry = smallestFold(rx), smallestFold(ry); rx != ry {
			return cmp.Compare(rx, ry)
		}
		x, y = x[nx:], y[ny:]
	}
	return cmp.Compare(len(x), len(y))
}

// FuzzJSONDigest checks the canonical form against encoding/json: two
// bodies with one canonical digest decode to the same value (with
// json.Number, so a number counts as its literal), a body re-encoded by
// encoding/json (no whitespace, keys sorted, strings escaped its way) or
// indented keeps its digest, what is canonical is valid JSON, and the
// text is never longer than the body.
func FuzzJSONDigest(f *testing.F) {
	for _, s := range []string{
		`{"b":[1,2,{"y":null,"x":true}],"a":"\u00e9\n"}`,
		`{"a":1,"a":2}`, `[1.0,-0,1e5,1E+5]`, `"\ud83d\ude00<>&"`, `{}`, `[]`, `0`,
		`{"k":"` + strings.Repeat("v", 40) + `","j":[` + strings.Repeat(`{"z":1,"y":2},`, 5) + `0]}`,
		"\"\xff\"", `"\ud800"`, `[[[[[[[[[[]]]]]]]]]]`,
	} {
		f.Add([]byte(s), []byte(" "+s+"\n"))
	}
	f.Fuzz(func(t *testing.T, a, b []byte) {
		da, aok := jsonDigest(a)
		db, bok := jsonDigest(b)
		for _, in := range [][]byte{a, b} {
			text, ok, inPlace := canonicalText(in)
			if !ok {
				continue
			}
			if !json.Valid(in) {
				t.Fatalf("%q is canonical but not valid JSON", in)
			}
			if !inPlace || len(text) > len(in) {
				t.Fatalf("%q: the canonical text (%d bytes) outgrew the body", in, len(text))
			}
			// Re-encoded by encoding/json, when that is the same value:
			// every string UTF-8 (else it writes U+FFFD) and no key twice
			// (else it keeps the last).
			if v, err := decodeJSON(in); err == nil && !hasDuplicateKey(in) {
				re, err := json.Marshal(v)
				if err != nil {
					t.Fatal(err)
				}
				if d, ok := jsonDigest(re); !ok || d != mustDigest(t, in) {
					t.Fatalf("%q and its re-encoding %q: not one request", in, re)
				}
			}
			var indented bytes.Buffer
			if err := json.Indent(&indented, in, "", "  "); err == nil {
				if d, ok := jsonDigest(indented.Bytes()); !ok || d != mustDigest(t, in) {
					t.Fatalf("%q indented: not one request", in)
				}
			}
		}
		if aok && bok && da == db {
			va, erra := decodeJSON(a)
			vb, errb := decodeJSON(b)
			if erra != nil || errb != nil || !reflect.DeepEqual(va, vb) {
				t.Fatalf("%q and %q are one request to the fingerprint but not to encoding/json", a, b)
			}
		}
	})
}

func mustDigest(t *testing.T, b []byte) [sha256.Size]byte {
	d, ok := jsonDigest(b)
	if !ok {
		t.Fatalf("%q: not canonical", b)
	}
	return d
}

func decodeJSON(b []byte) (any, error) {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, fmt.Errorf("more after the value")
	}
	return v, nil
}

// hasDuplicateKey reports whether an object in b (valid JSON) has a key
// twice, or two that fold alike (the canonical form keeps them in the
// order sent, encoding/json writes them sorted), or a string that is not
// UTF-8 (encoding/json would change it).
func hasDuplicateKey(b []byte) bool {
	if !utf8.Valid(b) || bytes.Contains(b, []byte(`\ud`)) || bytes.Contains(b, []byte(`\uD`)) {
		return true // a surrogate escape: let the other checks speak
	}
	dec := json.NewDecoder(bytes.NewReader(b))
	type level struct {
		keys      map[string]bool // nil for an array
		expectKey bool
	}
	var stack []*level
	valueDone := func() {
		if len(stack) > 0 && stack[len(stack)-1].keys != nil {
			stack[len(stack)-1].expectKey = true
		}
	}
	for {
		tok, err := dec.Token()
		if err != nil {
			return false
		}
		if n := len(stack); n > 0 && stack[n-1].keys != nil && stack[n-1].expectKey {
			top := stack[n-1]
			if tok == json.Delim('}') {
				stack = stack[:n-1]
				valueDone()
				continue
			}
			k := string(foldKey(nil, []byte(tok.(string))))
			if top.keys[k] {
				return true
			}
			top.keys[k], top.expectKey = true, false
			continue
		}
		switch tok {
		case json.Delim('{'):
			stack = append(stack, &level{keys: map[string]bool{}, expectKey: true})
		case json.Delim('['):
			stack = append(stack, &level{})
		case json.Delim(']'):
			stack = stack[:len(stack)-1]
			valueDone()
		default:
			valueDone()
		}
	}
}

// sharedPrefixKeys is an object of n members whose keys are prefix
// repeated count times and then a number, in descending order: a sort
// that compares each pair of keys from their start reads the prefix every
// time.
func sharedPrefixKeys(prefix string, count, n int) []byte {
	var buf bytes.Buffer
	buf.WriteByte('{')
	for i := n - 1; i >= 0; i-- {
		fmt.Fprintf(&buf, `"%s%04d":0`, strings.Repeat(prefix, count), i)
		if i > 0 {
			buf.WriteByte(',')
		}
	}
	buf.WriteByte('}')
	return buf.Bytes()
}

// BenchmarkJSONDigest measures a 1 MiB body (WithHTTPMaxRequestBytes's
// default) of several shapes: what the canonical digest allocates against
// the body's size, next to the digest of the bytes and to encoding/json
// decoding the body into an any.
func BenchmarkJSONDigest(b *testing.B) {
	const size = 1 << 20
	fill := func(unit func(i int) string, open, sep, close string) []byte {
		var buf bytes.Buffer
		buf.WriteString(open)
		for i := 0; ; i++ {
			u := unit(i)
			if buf.Len()+len(u)+len(sep)+len(close) > size {
				break
			}
			if i > 0 {
				buf.WriteString(sep)
			}
			buf.WriteString(u)
		}
		buf.WriteString(close)
		return buf.Bytes()
	}
	shapes := []struct {
		name string
		body []byte
	}{
		{"records", fill(func(i int) string {
			return fmt.Sprintf(`{"id":"ch_%08d","account_id":"acct-%d","amount_cents":%d,"currency":"EUR","tags":["a","b"],"paid":true}`, i, i%97, i*7)
		}, "[", ", ", "]")},
		{"flat_object_tiny_members", fill(func(i int) string { return fmt.Sprintf(`"%x":0`, i) }, "{", ",", "}")},
		// Keys in no order: a stable sort in place moves each member
		// log(n) times per merge level.
		{"flat_object_keys_in_random_order", fill(func(i int) string { return fmt.Sprintf(`"%05x":0`, (i*7919)%(1<<17)) }, "{", ",", "}")},
		{"flat_object_smallest_members", fill(func(int) string { return `"":0` }, "{", ",", "}")}, // the most members a body holds
		{"array_of_small_numbers", fill(func(int) string { return "0" }, "[", ",", "]")},
		{"array_of_empty_objects", fill(func(int) string { return "{}" }, "[", ",", "]")},
		{"long_string", []byte(`"` + strings.Repeat("é", (size-2)/2) + `"`)},
		{"nested_to_the_limit", []byte(strings.Repeat(`{"a":[`, maxJSONDepth/2) + strings.Repeat("]}", maxJSONDepth/2))},
		{"keys_sharing_a_folding_prefix", sharedPrefixKeys("\u0345", 1000, 500)},
		{"keys_sharing_an_ascii_prefix", sharedPrefixKeys("k", 2000, 500)},
		{"one_key_of_cased_runes", []byte(`{"` + strings.Repeat("ͅΣσςſKǅẞ", size/20) + `":0}`)},
		{"one_key_of_uncased_runes", []byte(`{"` + strings.Repeat("中", (size-6)/3) + `":0}`)},
		{"escaped_string", []byte(`"` + strings.Repeat(`\u00e9`, (size-2)/6) + `"`)},
		{"long_numbers", fill(func(int) string { return "-" + strings.Repeat("9", 500) + ".5e-99" }, "[", ",", "]")},
		{"nested_objects_of_two_members", []byte(strings.Repeat(`{"b":0,"a":`, maxJSONDepth-1) + "0" + strings.Repeat("}", maxJSONDepth-1))},
	}
	for _, s := range shapes {
		if _, ok := jsonDigest(s.body); !ok {
			b.Fatalf("%s: not canonical", s.name)
		}
		b.Run(s.name+"/canonical", func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(s.body)))
			for b.Loop() {
				jsonDigest(s.body)
			}
		})
		b.Run(s.name+"/bytes", func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(s.body)))
			for b.Loop() {
				sha256.Sum256(s.body)
			}
		})
		b.Run(s.name+"/encoding_json_any", func(b *testing.B) {
			b.ReportAllocs()
			b.SetBytes(int64(len(s.body)))
			for b.Loop() {
				_, _ = decodeJSON(s.body)
			}
		})
	}
}
